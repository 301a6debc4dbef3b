"""The built models' tokenizer vocabulary (models/vocabulary.py) is the models layer's own, and the tokenizers built
over it are byte-identical to those the builders made when they read the word list from the toy world
(worlds.toyworld.dataset.vocabulary): same words, same ids, so every built model is the same model as before."""
import pytest

from ddpo_grpo.models import flux, sd3, sd15_random, sdxl, wan
from ddpo_grpo.models.tiny import clip_tokenizer, t5_tokenizer
from ddpo_grpo.models.vocabulary import vocabulary
from ddpo_grpo.worlds.toyworld.dataset import vocabulary as toy_vocabulary

PROMPTS = ["a red circle on the left", "a blue square above a cyan cross", "a photo of a cat",
           "a video of a green cross moving"]
# Token ids of PROMPTS (no padding) from each builder's tokenizer, recorded with the builders as they were before the
# vocabulary moved (they imported worlds/toyworld/dataset.py).
GOLDEN = {
    "sd15": [[120, 22, 113, 81, 109, 117, 106, 121], [120, 22, 71, 116, 60, 22, 85, 84, 121],
             [120, 22, 110, 108, 22, 72, 121],
             [120, 22, 19, 8, 3, 4, 34, 108, 22, 98, 84, 10, 12, 19, 8, 11, 28, 121]],
    "sdxl": [[110, 22, 103, 77, 99, 107, 96, 111], [110, 22, 68, 106, 58, 22, 81, 80, 111],
             [110, 22, 100, 98, 22, 2, 0, 39, 111],
             [110, 22, 19, 8, 3, 4, 34, 98, 22, 90, 80, 10, 12, 19, 8, 11, 28, 111]],
    "sd3": [[3, 20, 10, 18, 23, 15, 1], [3, 8, 22, 4, 3, 12, 11, 1], [3, 19, 17, 3, 27, 30, 28, 47, 1],
            [3, 27, 49, 36, 31, 32, 42, 17, 3, 13, 11, 27, 40, 42, 49, 36, 41, 34, 1]],
    "flux": [[114, 22, 106, 78, 102, 110, 99, 115], [114, 22, 69, 109, 58, 22, 82, 81, 115],
             [114, 22, 103, 101, 22, 2, 0, 39, 115],
             [114, 22, 19, 8, 3, 4, 34, 101, 22, 91, 81, 10, 12, 19, 8, 11, 28, 115]],
    "wan": [[3, 20, 10, 19, 23, 15, 1], [3, 8, 22, 4, 3, 12, 11, 1],
            [3, 28, 54, 46, 53, 58, 53, 18, 3, 28, 41, 39, 58, 1], [3, 25, 18, 3, 13, 11, 17, 1]],
}


def built(name: str):
    """(tokenizer as the builder makes it now, the same built from the toy world's words as the builder did)."""
    toy = toy_vocabulary()
    if name == "sd15":
        return (sd15_random.build_tokenizer(),
                clip_tokenizer(toy + list(sd15_random.EXTRA_WORDS), sd15_random.SD_MAX_TOKENS))
    if name == "sdxl":
        return (clip_tokenizer(sdxl._words(), sdxl.SDXL_TOKENS),
                clip_tokenizer(toy + list(sdxl.TINY_WORDS), sdxl.SDXL_TOKENS))
    if name == "sd3":
        return (t5_tokenizer(sd3._words(), sd3.TINY_MAX_TOKENS),
                t5_tokenizer(sorted(set(toy) | set(sd3.EXTRA_WORDS)), sd3.TINY_MAX_TOKENS))
    if name == "flux":
        return (clip_tokenizer(flux._words(), flux.TINY_MAX_TOKENS),
                clip_tokenizer(sorted(set(toy) | set(flux.EXTRA_WORDS)), flux.TINY_MAX_TOKENS))
    return (wan.build_umt5_tokenizer(),
            wan.build_umt5_tokenizer(sorted(set(toy) | set(wan.EXTRA_WORDS))))


def test_the_models_vocabulary_is_the_toy_worlds_word_list():
    assert vocabulary() == toy_vocabulary()  # the same words in the same order: the ids follow the order
    assert vocabulary() == sorted(set(vocabulary()))


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_builder_tokenizers_give_the_ids_they_gave(name):
    now, before = built(name)
    assert now.get_vocab() == before.get_vocab()
    assert [now(p).input_ids for p in PROMPTS] == GOLDEN[name] == [before(p).input_ids for p in PROMPTS]
