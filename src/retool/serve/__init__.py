"""retool.serve: the PyTRIO and Tinker training APIs on this machine (``retool serve``).

A FastAPI + uvicorn server (``app``, ``server``) whose two wire layers (``pytrio_api``, ``tinker_api``) speak
what the installed SDKs send, over one state (``state``: models, training runs, samplers) backed by the
local backend, with everything clients save under one root folder (``storage``).
"""
