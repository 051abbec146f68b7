"""What users touch: the OpenAI-compatible HTTP server, its protocol types, chat templates,
request guards, batch runs and metrics, the `aserve` command line, and the offline `LLM` API.

The engine imports none of these modules.
"""
