"""The OpenAI-compatible gateway of the rollout service: `requests` (bodies parsed and checked),
`responses` (reply bodies and stream chunks), `calls` (one call end to end over a model catalog),
`app` (the HTTP routes, FastAPI), `run_models` (the rollout service's runs as served models).
`furlong serve` (`furlong.rollout.serve_cli`) serves one model directory with it."""
