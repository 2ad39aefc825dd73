"""wicore: queue-driven batch inference for multimodal LLMs.

Light on purpose: `import wicore.producer` must not pull torch or transformers.
"""

__version__ = "0.1.0"
