"""Every source of the drafters' training text, one file each, and the recipe that mixes them.

``subtasks`` (the agent-subtask generator, also the router's workload), ``stdlib`` (requests about the standard
library's code and docstrings), ``synthesis`` (turns the target writes itself), ``evaluation`` (the prompts kept
out), ``recipe`` (counts, answering, filtering, manifest). :mod:`backends.training.dataset` runs the recipe
through the target.
"""
