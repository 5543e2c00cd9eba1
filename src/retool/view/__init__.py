"""retool.view: see the rollouts. The trajectory record and its writers (``records``), the static site
(``site``) that ``retool view`` builds from training runs and evals, its local server (``serve``) and
the headless-browser helpers the tests, the bench and the README screenshot share (``browser``).

Kept import-light on purpose: the training loop and the eval runner import ``retool.view.records``.
"""
