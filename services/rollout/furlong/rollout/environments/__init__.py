"""Built-in multi-turn environments (`calculator`, `python`) and how a run's environment is built
from its name (`registry`)."""
