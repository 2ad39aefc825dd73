"""The text the local tokenizers are trained on: prompts, the demo captioner's grammar, and
common English, so that ordinary prompts tokenize into words rather than bytes."""

from __future__ import annotations

COLORS = ["red", "green", "blue", "yellow", "orange", "purple", "white", "black"]
SHAPES = ["circle", "square", "triangle", "star", "cross"]

PROMPTS = [
    "Describe this image in detail.",
    "Describe this image.",
    "What is in this picture?",
    "Write a short caption for this image.",
    "What color is the shape?",
    "What shape is shown, and on what background?",
]

COMMON_WORDS = """
the of and to in is it that for on with as was at by this be are from or an have not they
which one you were all we her she there been their has would when will more no if out so
what up about into than them can only other new some could time these two may then do
first any my now such like our over man me even most made after also did many before must
through back years where much your way well down should because each just those people how
too little state good very make world still own see men work long get here between both
life being under never day same another know while last might us great old year off come
since against go came right used take three image picture photo shows shown color colour
shape object background foreground left right top bottom center middle small large bright
dark light detail details describe caption answer question short long text words scene
""".split()


def caption_lines() -> list[str]:
    lines = []
    for color in COLORS:
        for shape in SHAPES:
            for background in COLORS:
                if background == color:
                    continue
                a = "an" if color[0] in "aeiou" else "a"
                b = "an" if background[0] in "aeiou" else "a"
                lines.append(f"{a} {color} {shape} on {b} {background} background")
    return lines


def tokenizer_corpus() -> list[str]:
    """Deterministic: the same list on every machine and every run."""
    words = " ".join(COMMON_WORDS)
    return PROMPTS * 20 + caption_lines() + [words] * 5 + [w.capitalize() for w in COMMON_WORDS]
