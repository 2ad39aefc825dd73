"""The demo captioner: a small Gemma-3 trained here to caption one shape on a plain background
("a red circle on a blue background"). Its checkpoint ships in `checkpoint/` (model card beside
the weights) and is the default model of `wicore caption`.

The parts: the task's image generator (`data`), a second, independent renderer for robustness
checks (`alt_render`), a batch renderer at the model's input size for training (`synth`),
examples as the model sees them (`batches`: images through the user's path, token layouts), the
architecture (`model`: the conversation layouts it answers, `LAYOUTS`), the training script
(`train`: ~32 minutes on 2 CPU cores, deterministic) and the evaluation through `wicore caption`
(`evaluate`).
"""
