"""retool-rl: teach language models to use a Python interpreter strategically, by reinforcement learning.

Pipeline stages (one subpackage each, data flowing one way)::

    data -> protocol -> rollout <-> sandbox -> reward -> train -> evaluate -> analyze

``backends`` hides where sampling and training happen; ``tasks`` holds the embedded tiny-model demo.
"""

__version__ = "0.1.0"
