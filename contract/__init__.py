"""trainguard.contract: the torch-free leaf every other package may import.

* :mod:`~trainguard.contract.protocol` — the worker <-> agent <-> CLI contract: the environment
  variables, the exit codes, the value enums metric labels derive from, the control messages;
* :mod:`~trainguard.contract.log` — structlog set-up, one event per line;
* :mod:`~trainguard.contract.configbase` — typed config building blocks whose errors name the YAML
  key, the env var and the fix.

It imports nothing of trainguard and nothing heavier than the standard library and structlog, so
the packages stack without a cycle (``tests/test_layering.py`` keeps it so)::

    contract < checkpoint < strategies < runtime < agent
    contract < metrics < runtime            (metrics observe, never steer)
"""
