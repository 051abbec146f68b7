"""The engine's internals: `Engine` (engine.py), its asyncio actors (actors.py), the model
runner, the request and sequence types (sequence.py), the configuration, CUDA graphs, host
tuning, errors, and the step-cost probe.

Nothing is imported here, so the torch-free modules (sequence, config, errors) load without
torch; import from the modules themselves.
"""
