"""User reward callables referenced by `module:function` in the rollout reward tests."""


def length_reward(response_text, answer):
    return float(len(response_text))


def needs_three(response_text, answer, extra):
    return 0.0


not_callable = 3
