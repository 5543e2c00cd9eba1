"""retool.view: see the rollouts. The static site (``site``) that ``retool view`` builds from training
runs and evals and its local server (``serve``). (The synthetic runs and the headless browser its tests,
bench and README screenshot use are test helpers: ``tests/synthetic_runs.py``, ``tests/headless_browser.py``.)

The trajectory record it reads is written by training and evaluation (``retool.train.records``); this
package sits above them and below ``retool.pipeline`` (the demo writes its view).
"""
