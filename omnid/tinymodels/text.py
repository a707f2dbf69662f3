"""The tiny Llama (``ROOT/llm``): its byte-level BPE tokenizer trained on a small built-in English
corpus, and random weights nudged so that sampled tokens are whole words or punctuation. The
multimodal, speech and LoRA builders start from its tokenizer, sizes and nudge.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omnid.tinymodels.build import SEED, build_atomically, offline_env, seed_all

LLM_DTYPE = "bfloat16"
LLM_HIDDEN = 128
LLM_HEADS = 2
LLM_HEAD_DIM = 64
LLM_LAYERS = 2
LLM_INTERMEDIATE = 256
LLM_MAX_POSITIONS = 512
LLM_VOCAB = 1000

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
# A plain "role: content" chat template, so that chat requests (`messages`, /v1/chat/completions)
# render as on a real model. Like real templates it writes the BOS itself: a rendered chat is
# tokenized without the tokenizer's own special tokens.
LLM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

CORPUS = """\
The morning was cold and clear, and the old town was quiet under a pale blue sky.
A small boat moved slowly across the harbor while the fishermen pulled their nets.
People walked along the river to the market, where farmers sold bread, cheese, apples and fresh fish.
The children ran to school with their books, laughing and talking about the long summer.
In the library, a young woman read a story about a king who lost his crown in the forest.
She wanted to learn how the world worked, so she studied history, science, music and language.
Her brother built a wooden table for the kitchen and painted it green and yellow.
When the rain began to fall, everyone found a place to sit and wait for the storm to pass.
The teacher said that a good question is often more useful than a quick answer.
Every evening the family shared a simple meal of soup, rice, beans and warm tea.
The city has many bridges, and each bridge has a name that tells an old story.
A computer can follow a list of instructions very quickly, but it cannot decide what matters.
Good software is clear, small and easy to change, and it should be tested with care.
The engineer wrote a short program that reads a file, counts the words and prints a report.
If the server is busy, the request waits in a queue until a worker is free to handle it.
A model learns patterns from data, and the quality of the data shapes what the model can do.
The garden behind the house was full of roses, tall grass, tomatoes and bright sunflowers.
Birds sang in the trees while a gentle wind carried the smell of flowers through the window.
On the weekend they climbed the mountain and looked down at the valley and the distant sea.
The night was dark, but the stars were bright, and the moon rose slowly over the hills.
He opened the door, turned on the light and saw that the room was exactly as he had left it.
The doctor listened carefully, wrote a few notes and told him to rest for a week.
Travel teaches patience, because trains are late, roads are long and plans often change.
A friend is someone who listens, helps when things are hard and laughs with you when they are easy.
The museum showed paintings of ships, horses, castles, gardens and people at work.
Winter brings snow and short days, while spring brings rain, green leaves and new life.
The baker wakes before dawn to make bread, cakes and sweet rolls for the whole street.
Music filled the hall as the orchestra played a slow song that everyone seemed to know.
She wrote a letter to her grandmother, describing the new house, the garden and the dog.
The scientists measured the temperature of the water every hour for three months.
Numbers such as one, two, three, ten, twenty and one hundred are easy words to learn.
Colors like red, orange, yellow, green, blue, purple, black, white and brown are everywhere.
The market was busy, the streets were crowded and the air was full of voices and music.
A careful reader asks why the author chose each word and what the story means today.
The company built a new factory near the coast and hired workers from the nearby villages.
They planted trees along the road, and after many years the trees gave shade to travelers.
Learning a new skill takes time, practice and the courage to make mistakes and try again.
The cat slept in the sun on the window, and the dog waited by the door for its walk.
At the end of the day, the lights of the houses shone softly across the quiet water.
What do you think will happen next? Nobody knows, but we can always hope for the best.
Please write your name, your address and the date at the top of the first page.
The answer was simple: work together, share the tools and finish the job before night.
"""


def _corpus_lines() -> Iterator[str]:
    """Yield the built-in training corpus one line at a time."""
    yield from (line for line in CORPUS.splitlines() if line.strip())


def train_llm_tokenizer() -> Any:
    """Train a byte-level BPE tokenizer and wrap it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=LLM_VOCAB,
        min_frequency=1,
        special_tokens=[UNK, BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=LLM_MAX_POSITIONS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=LLM_CHAT_TEMPLATE,
    )


def wordlike_token_ids(tokenizer: Any) -> list[int]:
    """Return ids of tokens that decode to " word" (a whole corpus word) or punctuation."""
    words = set(re.findall(r"[A-Za-z]+", CORPUS))
    special = set(tokenizer.all_special_ids)
    good = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if i in special:
            continue
        if text in (".", ",", "!", "?") or (text[:1] == " " and text[1:] in words):
            good.append(i)
    return good


def nudge_llm_weights(model: Any, good_ids: list[int]) -> None:
    """Make a random Llama emit only word-like tokens.

    Hidden dimension 0 of the residual stream is held at a constant 1 (set in
    every embedding, never written by attention or MLP outputs), which turns
    column 0 of ``lm_head`` into a per-token logit bias: 0 for word-like
    tokens and a large negative value for everything else.
    """
    import torch

    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        emb[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        head = model.lm_head.weight
        head.normal_(0.0, 0.2)
        head[:, 0] = -40.0
        head[good_ids, 0] = 0.0


def build_llm(model_dir: Path) -> Path:
    """Build the tiny Llama and its tokenizer into `model_dir`; return the folder."""
    offline_env()

    def fill(out: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        seed_all(SEED)
        tokenizer = train_llm_tokenizer()
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=LLM_HIDDEN,
            intermediate_size=LLM_INTERMEDIATE,
            num_hidden_layers=LLM_LAYERS,
            num_attention_heads=LLM_HEADS,
            num_key_value_heads=LLM_HEADS,
            head_dim=LLM_HEAD_DIM,
            max_position_embeddings=LLM_MAX_POSITIONS,
            rms_norm_eps=1e-6,
            initializer_range=0.1,
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        seed_all(SEED)
        model = LlamaForCausalLM(config)
        nudge_llm_weights(model, wordlike_token_ids(tokenizer))
        model = model.to(getattr(torch, LLM_DTYPE)).eval()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return build_atomically(model_dir, "llm", fill)
