"""Real SentencePiece vocabularies for the KV-cache events tests, with no downloads.

mistral_common (a vLLM dependency) ships Mistral's own SentencePiece models (7B v0.1's
32,000 pieces; v3's 32,768 with [INST] control tokens). ``mistral`` turns one into the
tokenizer.json + tokenizer_config.json a Hugging Face model directory has, as transformers
converts it; ``encode`` tokenises texts as vLLM's transformers does. Both need the vLLM
environment (transformers, sentencepiece, mistral_common); run with its interpreter:

    PYTHONPATH=<repo> <vllm-venv>/bin/python -m extproc.tokenizer_probe mistral --version v3 --out DIR
    echo '["text"]' | PYTHONPATH=<repo> <vllm-venv>/bin/python -m extproc.tokenizer_probe encode DIR

The router side imports only the standard library from here (the template).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# Mistral-7B-Instruct's template: user and assistant turns alternating, a user's first.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported') }}"
    "{% endif %}{% endfor %}"
)
# Phi-3's shape (its tokeniser is this Llama class too): each marker an added token that
# absorbs the whitespace after it (rstrip), as Phi-3's do.
PHI3_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PHI3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% else %}{{ eos_token }}{% endif %}"
)
MODELS = {
    "v1": "tokenizer.model.v1",
    "v3": "mistral_instruct_tokenizer_240323.model.v3",
}


def mistral(out: Path, version: str, legacy: bool | None, markers: bool = False) -> Path:
    """``out``: tokenizer.json and tokenizer_config.json (LlamaTokenizer, the template,
    ``legacy`` if not None) for mistral_common's bundled ``version`` model; ``markers``:
    with Phi-3's markers added and its template instead of Mistral's."""
    import mistral_common
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    source = Path(mistral_common.__file__).parent / "data" / MODELS[version]
    work = out.with_name(out.name + ".sentencepiece")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copy(source, work / "tokenizer.model")
    config: dict[str, object] = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": PHI3_CHAT_TEMPLATE if markers else MISTRAL_CHAT_TEMPLATE,
    }
    if legacy is not None:
        config["legacy"] = legacy
    (work / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(work)
    if markers:
        extra = [AddedToken(m, rstrip=True, normalized=False, special=True) for m in PHI3_MARKERS]
        tokenizer.add_special_tokens({"additional_special_tokens": extra})
    tokenizer.save_pretrained(out)
    (out / "tokenizer_config.json").write_text(json.dumps(config))  # as written, no defaults
    shutil.rmtree(work)
    return out


def encode(directory: Path, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("mistral", help="write a tokenizer directory")
    build.add_argument("--version", choices=sorted(MODELS), required=True)
    build.add_argument("--legacy", choices=("unset", "true", "false"), default="unset")
    build.add_argument("--out", required=True)
    build.add_argument("--phi3-markers", action="store_true", help="Phi-3's markers, template")
    tokenise = commands.add_parser("encode", help="JSON list of texts on stdin -> token ids")
    tokenise.add_argument("directory")
    tokenise.add_argument("--special", action="store_true", help="add the BOS (completions)")
    args = parser.parse_args(argv)
    if args.command == "mistral":
        legacy = None if args.legacy == "unset" else args.legacy == "true"
        mistral(Path(args.out), args.version, legacy, args.phi3_markers)
        return 0
    print(json.dumps(encode(Path(args.directory), json.load(sys.stdin), args.special)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
