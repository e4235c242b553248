"""The tokenizer the data is prepared with: the checkpoint's HF tokenizer with the config's special tokens and added
tokens, or mistral-common's for `data.mistral_common` (Axolotl's tokenizer_use_mistral_common: Mistral's own
instruct encoding of conversations from the checkpoint's tekken.json, which the HF tokenizer and a chat template need
not reproduce; ChatFormatter (templates.py) encodes through it and finds each turn over token ids)."""
from __future__ import annotations

from pathlib import Path

from adapter.config import spell
from adapter.errors import bad


def load_tokenizer(cfg, tokenizer_dir: Path, vocab_size: int):
    """The checkpoint's tokenizer with the config's `special_tokens` set and its `tokens` added, in Axolotl's order
    (loaders/tokenizer.py: each named special token, then `tokens`, then additional_special_tokens; new ones get
    new ids, which adapter/models/vocab.py counted for the run's embedding rows); `vocab_size`: those rows."""
    key = lambda k: spell(cfg, f"data.{k}")  # noqa: E731  (as the user wrote it)
    if cfg.data.mistral_common:
        return mistral_tokenizer(tokenizer_dir, key("mistral_common"))
    from tokenizers import AddedToken
    from transformers import AutoTokenizer  # heavy: imported where used (adapter/data/__init__.py)

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def added(t: str):
        return AddedToken(t, rstrip=False, lstrip=False, normalized=False)

    given = cfg.data.special_tokens.model_dump(exclude_none=True)
    additional = given.pop("additional_special_tokens", None)
    for name, value in given.items():
        tok.add_special_tokens({name: added(value)})
    if cfg.data.tokens:  # as Axolotl adds them (adapter/models/vocab.py): a token the vocabulary has gets no new id
        tok.add_tokens([added(t) for t in cfg.data.tokens])
    if additional:
        tok.add_special_tokens({"additional_special_tokens": additional})
    rows = -(-len(tok) // 32) * 32 if cfg.data.resize_vocab_to_32x else len(tok)
    if rows > vocab_size:  # the run's vocabulary was grown from tokenizer.json: this tokenizer must agree with it
        which = "tokens" if cfg.data.tokens else "resize_vocab_to_32x" if cfg.data.resize_vocab_to_32x else \
            "special_tokens"
        raise bad(key(which), getattr(cfg.data, which), f"the tokenizer transformers loads has {len(tok)} tokens "
                  f"({rows} rows), more than the {vocab_size} embedding rows counted from its tokenizer.json",
                  "save the tokenizer again (tokenizer.json and tokenizer_config.json must hold the same tokens)")
    if not getattr(tok, "is_fast", False):
        raise bad("model.path", str(tokenizer_dir), "the tokenizer has no fast (tokenizer.json) version, which "
                  "masking needs for character offsets", "save the tokenizer with tokenizer.json")
    return tok


def mistral_tokenizer(tokenizer_dir: Path, where: str):
    """The checkpoint's mistral-common tokenizer (tekken.json, or a SentencePiece tokenizer.model.v*) as Axolotl
    loads it for tokenizer_use_mistral_common (utils/mistral/mistral_tokenizer.py: transformers'
    MistralCommonBackend, its request validator in finetuning mode, where a conversation must end with the
    assistant's turn)."""
    try:
        from mistral_common.protocol.instruct.validator import ValidationMode
        from transformers.tokenization_mistral_common import MistralCommonBackend
    except ImportError as e:
        raise bad(where, True, f"needs the mistral-common library ({e})", "pip install mistral-common") from None
    files = sorted(p for p in Path(tokenizer_dir).iterdir() if p.name == "tekken.json"
                   or p.name.startswith("tokenizer.model.v"))
    if not files:
        raise bad(where, True, f"{tokenizer_dir} has no mistral-common tokenizer (tekken.json or tokenizer.model.v*)",
                  "point the model at a Mistral checkpoint that ships one, or set it to false (the HF tokenizer)")
    try:
        return MistralCommonBackend.from_pretrained(str(tokenizer_dir), mode=ValidationMode.finetuning)
    except Exception as e:  # a file mistral-common cannot read
        raise bad(where, True, f"mistral-common could not load {files[0]}: {type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''}", "check the checkpoint's tokenizer file") from None


__all__ = ["load_tokenizer", "mistral_tokenizer"]
