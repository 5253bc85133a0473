"""Model configs, leaves of the import graph: DeepseekV4Config (Hugging Face config.json
compatible, deepseek_v4.py), the built-in presets (presets.py), and a model path resolved to a
config (loader.py). Import each from its module."""
