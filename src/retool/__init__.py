"""retool-rl: teach language models to use a Python interpreter strategically, by reinforcement learning.

Pipeline stages (one subpackage each, data flowing one way)::

    data -> protocol -> env (sandbox, reward) -> rollout -> train -> evaluate -> analyze

``backends`` hides where sampling and training happen; ``env`` says which problems a run sees and owns
each trajectory's interaction (``Env.step``: parse, call the tool, observe, budgets, reward); ``rollout``
only schedules many environments over one policy; ``components`` builds a run's parts from its config; ``tasks`` holds the embedded
tiny-model demo on top of it all. ``docs/ARCHITECTURE.md`` draws the layers.
"""

__version__ = "0.1.0"
