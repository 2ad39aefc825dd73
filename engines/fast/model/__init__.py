"""Our own Gemma-3 modules for serving: the SigLIP tower and projector (`vision_tower`), the text
decoder over packed tokens (`text_decoder`), their shared layers, and loading (`weights`)."""
