"""The words the built models' tokenizers know: the word-level CLIP and T5 / UMT5 tokenizers (models/tiny.py:
clip_tokenizer, t5_tokenizer) of the random real-shape builds (sd15-random, sdxl-random, sd35-medium-random,
flux-dev-random, wan21-1.3b-random) and of the tiny builds (sdxl-tiny, sd3-tiny, flux-tiny, wan-tiny).

A word-level tokenizer's ids follow from its word list, and a built model's token ids are part of what the model is, so
the list is written out here, fixed: the words of the prompts these models are run with (the toy world's, "a red
circle on the left", "a blue square above a cyan cross"). It lives in the models layer because a model must not import
a world (tests/test_import_graph.py checks that none does); tests/test_model_vocabulary.py checks that it is still
every toy-world prompt word and that each builder's tokenizer gives the ids it gave when it read the list from the
toy world. Each builder adds its own few generic words (its EXTRA_WORDS / TINY_WORDS).
"""
from __future__ import annotations

from typing import List

COLOURS = ("red", "green", "blue", "yellow", "magenta", "cyan")
SHAPES = ("square", "circle", "triangle", "cross")
PLACES = ("left", "center", "right")
RELATIONS = ("left of", "right of", "above", "below")
GLUE = ("a", "on", "the", "in")  # "a red circle on the left", "a cyan cross in the center"


def vocabulary() -> List[str]:
    """Every word of the prompts above, sorted (each once): the order the builders' tokenizers number them in."""
    words = set(COLOURS) | set(SHAPES) | set(PLACES) | set(GLUE)
    words.update(w for rel in RELATIONS for w in rel.split())
    return sorted(words)
