"""A tiny random-weight Llama with a locally trained tokenizer: a real model for vLLM, no downloads.

Random weights are enough for routing tests and benchmarks: prefill cost and prefix caching
behave exactly as with trained weights; only the generated text is nonsense. The recipe
(architecture, tokenizer, corpus, seed) is fixed here and hashed into the directory name, so
a cached build is reused until the recipe changes:

    <cache>/models/tiny-llama-<recipe hash>/
        config.json  generation_config.json  model.safetensors     (LlamaForCausalLM, bf16)
        tokenizer.json  tokenizer_config.json  special_tokens_map.json   (byte-level BPE)
        .complete                                                   (written last)

Building needs torch, transformers and tokenizers, which live in the vLLM environment, not
in the router's: run this module with that environment's interpreter (``extproc.lab`` does):

    PYTHONPATH=<repo> <vllm-venv>/bin/python -m extproc.model_fixture --out DIR

``--sentencepiece-for MODEL_DIR`` writes instead a SentencePiece-style tokeniser (Llama 2's
shape) that the same model serves with vLLM's ``--tokenizer`` (the KV-cache events tests), and
``--lora-for MODEL_DIR`` a LoRA adapter for it in PEFT's layout (vLLM's ``--lora-modules``).

The module imports only the standard library at top level, so the router side can compute
the directory (:func:`default_dir`) and check it (:func:`is_complete`) without torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import time
from pathlib import Path

RECIPE: dict[str, object] = {
    "version": 1,
    "seed": 1234,
    "model": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 1024,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    },
    "tokenizer": {"vocab_size": 4096, "corpus_lines": 20000, "min_frequency": 2},
}

BOS = "<|begin_of_text|>"
EOS = "<|eot|>"
PAD = "<|pad|>"
HEADER_START = "<|start_header|>"
HEADER_END = "<|end_header|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, HEADER_START, HEADER_END, "<|end_of_text|>"]

# Llama-3-like: every message as a header block; the assistant header when asked to generate.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\\n') %}{% endif %}"
    "<|start_header|>{{ message['role'] }}<|end_header|>\n\n{{ text }}<|eot|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header|>assistant<|end_header|>\n\n{% endif %}"
)

# Llama 3.2's shape in the same tokens: a system header with today's date (strftime_now),
# always, the system message after it. Not the fixture's own template (the recipe hash does
# not cover it): tests serve it with vLLM's --chat-template.
DATED_CHAT_TEMPLATE = (
    "{{ bos_token }}<|start_header|>system<|end_header|>\n\n"
    "Today Date: {{ strftime_now('%d %b %Y') }}\n\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}<|eot|>"
    "{% for message in rest %}<|start_header|>{{ message['role'] }}<|end_header|>\n\n"
    "{{ message['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header|>assistant<|end_header|>\n\n{% endif %}"
)

# A SentencePiece-style tokeniser for the same model (sentencepiece_tokenizer): Llama 2 /
# Mistral's shape, with [INST] and [/INST] as added tokens, as Mistral v0.3 has them, and
# as theirs, refusing a conversation that an assistant message starts (which a completion's
# "<s> text" would read as).
SP_BOS, SP_EOS, SP_UNK = "<s>", "</s>", "<unk>"
SP_SPECIAL_TOKENS = [SP_UNK, SP_BOS, SP_EOS, "[INST]", "[/INST]"]
SP_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and (loop.first or messages[loop.index0 - 1]['role']"
    " == 'system') %}{{ raise_exception('A conversation starts with a user message') }}"
    "{% endif %}"
    "{% if message['role'] == 'system' %}<<SYS>>\n{{ message['content'] }}\n<</SYS>>\n\n"
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)

# Words for the training corpus: common English, the domain words of the project's workloads,
# and generated syllable words so that unseen text still splits into multi-byte pieces.
_ENGLISH = (
    "the of and to in is that it for on with as was at by be this from or have an are not "
    "but had his they you were their one all we can her has there been if more when will "
    "would who so no she other its may these about into than two could time only first "
    "very then also some what any each which do how said up out many most after new just "
    "system user assistant answer question careful explain summarize document section page "
    "conversation turn reply please thanks detail example code function value result "
    "cache prefix token replica router envoy latency throughput model prompt batch decode "
    "prefill kernel memory tensor layer request stream header cluster metric queue policy "
    "schedule index block hash window context data network service deploy config signal "
    "health score weight share budget limit fast slow server client gateway proxy route"
)
_WORDS = _ENGLISH.split()
_SYLLABLE_TEXT = "ka lo mi ne ru sa te vi zo ba de fi go hu ja ke li mo nu pa qi ro su ta"
_SYLLABLES = _SYLLABLE_TEXT.split()


def recipe_hash() -> str:
    text = json.dumps({**RECIPE, "template": CHAT_TEMPLATE, "special": SPECIAL_TOKENS})
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_dir(cache_root: Path) -> Path:
    return cache_root / "models" / f"tiny-llama-{recipe_hash()}"


def is_complete(directory: Path) -> bool:
    marker = directory / ".complete"
    return marker.exists() and marker.read_text().strip() == recipe_hash()


def corpus(lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    made = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(600)]
    out = []
    for i in range(lines):
        pool = _WORDS if i % 3 else made
        words = [rng.choice(pool) for _ in range(rng.randint(8, 40))]
        if i % 7 == 0:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ",", ":"]))
    return out


def build(out: Path) -> Path:
    """Build the fixture into ``out`` (atomically: a temporary sibling, then renamed)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    seed = int(RECIPE["seed"])  # type: ignore[call-overload]
    tok_recipe: dict = RECIPE["tokenizer"]  # type: ignore[assignment]
    model_recipe: dict = dict(RECIPE["model"])  # type: ignore[call-overload]

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    # Tokenizer: byte-level BPE (any UTF-8 text encodes), trained on the generated corpus.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=tok_recipe["vocab_size"],
        min_frequency=tok_recipe["min_frequency"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(tok_recipe["corpus_lines"], seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_recipe["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tmp)
    # The chat template inside tokenizer_config.json, whatever this transformers version's
    # default (newer ones write a separate chat_template.jinja).
    config_path = tmp / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    tok_config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    (tmp / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n"
    )

    # Model: seeded random weights, saved as safetensors in bf16.
    torch.manual_seed(seed)
    dtype = model_recipe.pop("torch_dtype")
    config = LlamaConfig(
        vocab_size=len(fast),
        bos_token_id=fast.convert_tokens_to_ids(BOS),
        eos_token_id=fast.convert_tokens_to_ids(EOS),
        pad_token_id=fast.convert_tokens_to_ids(PAD),
        tie_word_embeddings=False,
        **model_recipe,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(tmp, safe_serialization=True)

    (tmp / ".complete").write_text(recipe_hash() + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def sentencepiece_tokenizer(
    out: Path, vocab_size: int, legacy: bool | None = None, tokenizer_class: str = "LlamaTokenizer"
) -> Path:
    """A Llama-class SentencePiece-style tokeniser (BPE with byte fallback, "▁" for spaces,
    ``<0xNN>`` byte pieces in the vocabulary, a BOS by its post-processor), trained on the
    fixture's corpus, of at most ``vocab_size`` tokens so that the tiny model serves it
    (vLLM's ``--tokenizer``). ``legacy`` goes to tokenizer_config.json (None: left out),
    where transformers reads it when it rebuilds a Llama tokeniser at load: unset or false
    puts a "▁" before the text's start only, true before every piece between added tokens;
    ``tokenizer_class`` "GemmaTokenizer" is rebuilt to put none anywhere.
    Needs the tokenizers package (the vLLM environment)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(unk_token=SP_UNK, byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SP_SPECIAL_TOKENS + byte_pieces,
        show_progress=False,
    )
    seed = int(RECIPE["seed"])  # type: ignore[call-overload]
    tokenizer.train_from_iterator(corpus(20000, seed), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{SP_BOS} $A",
        pair=f"{SP_BOS} $A {SP_BOS} $B",
        special_tokens=[(SP_BOS, tokenizer.token_to_id(SP_BOS))],
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    spec = json.loads(tokenizer.to_str())
    # As Llama's own files have them: the byte pieces in the vocabulary only, not added
    # tokens (the trainer adds them as both), and no normalizer (Metaspace splits instead).
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_pieces]
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {
        "type": "Metaspace",
        "replacement": "▁",
        "prepend_scheme": "first",
        "split": False,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False) + "\n")
    config: dict[str, object] = {
        "tokenizer_class": tokenizer_class,
        "bos_token": SP_BOS,
        "eos_token": SP_EOS,
        "unk_token": SP_UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": RECIPE["model"]["max_position_embeddings"],  # type: ignore[index]
        "chat_template": SP_CHAT_TEMPLATE,
    }
    if legacy is not None:
        config["legacy"] = legacy
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": SP_BOS, "eos_token": SP_EOS, "unk_token": SP_UNK}) + "\n"
    )
    return out


def lora_adapter(out: Path, model_dir: Path, rank: int = 8) -> Path:
    """A LoRA adapter for the model in ``model_dir``, in PEFT's layout (adapter_config.json,
    adapter_model.safetensors): rank ``rank`` on every layer's q_proj and v_proj, small
    random weights (both factors non-zero, so the adapter changes what the model writes).
    vLLM serves it under a name of its own (``--lora-modules NAME=DIR``), and keys its
    cached blocks by that name. Needs torch and safetensors (the vLLM environment)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    head_dim = hidden // int(config["num_attention_heads"])
    outputs = {
        "q_proj": int(config["num_attention_heads"]) * head_dim,
        "v_proj": int(config["num_key_value_heads"]) * head_dim,
    }
    generator = torch.Generator().manual_seed(int(RECIPE["seed"]))  # type: ignore[call-overload]
    tensors = {}
    for layer in range(layers):
        for module, size in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = 0.05 * torch.randn(rank, hidden, generator=generator)
            tensors[f"{name}.lora_B.weight"] = 0.05 * torch.randn(size, rank, generator=generator)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(outputs),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to build (skipped if complete)")
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    parser.add_argument(
        "--sentencepiece-for",
        metavar="MODEL_DIR",
        help="instead: write a SentencePiece-style tokeniser for that model into --out",
    )
    parser.add_argument(
        "--tokenizer-class",
        default="LlamaTokenizer",
        help="with --sentencepiece-for: tokenizer_config.json's tokenizer_class",
    )
    parser.add_argument(
        "--legacy",
        choices=("unset", "true", "false"),
        default="unset",
        help="with --sentencepiece-for: tokenizer_config.json's legacy",
    )
    parser.add_argument(
        "--lora-for",
        metavar="MODEL_DIR",
        help="instead: write a LoRA adapter for that model into --out",
    )
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser()
    if args.lora_for:
        lora_adapter(out, Path(args.lora_for))
        print(f"model fixture: a LoRA adapter in {out}")
        return 0
    if args.sentencepiece_for:
        config = json.loads((Path(args.sentencepiece_for) / "config.json").read_text())
        legacy = None if args.legacy == "unset" else args.legacy == "true"
        sentencepiece_tokenizer(out, int(config["vocab_size"]), legacy, args.tokenizer_class)
        print(f"model fixture: a SentencePiece-style tokeniser in {out}")
        return 0
    if is_complete(out) and not args.force:
        print(f"model fixture: {out} is complete ({recipe_hash()})")
        return 0
    started = time.monotonic()
    build(out)
    print(f"model fixture: built {out} in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
