"""retool.view: see the rollouts. The static site (``site``) that ``retool view`` builds from training
runs and evals, its local server (``serve``) and the headless-browser helpers the tests, the bench and
the README screenshot share (``browser``).

The trajectory record it reads is written by training and evaluation (``retool.train.records``); this
package sits above them and below ``retool.tasks`` (the demo writes its view).
"""
