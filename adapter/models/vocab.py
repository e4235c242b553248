"""Axolotl's `tokens:`: tokens added to the tokenizer, and the embedding grown for them, as Axolotl does it.

Axolotl (loaders/tokenizer.py) adds each listed token with `tokenizer.add_tokens(AddedToken(t, rstrip=False,
lstrip=False, normalized=False))` -- a token the vocabulary already has gets no new id, but it is matched whole from
then on, so the text tokenises the same way here -- and then (loaders/model.py `_resize_token_embeddings`) calls
transformers' `model.resize_token_embeddings(n, mean_resizing=cfg.mean_resizing_embeddings)` when the embedding has
fewer than n rows, n = len(tokenizer) (rounded up to 32 with `resize_token_embeddings_to_32x`); its schema's
`mean_resizing_embeddings` defaults to false, so the new rows of the embedding and of an untied LM head are drawn
from normal(0, initializer_range) (the model's `_init_weights`) unless the config asks for the old rows' mean and
covariance. A model whose embedding already has spare rows (Qwen's padding) is not resized: the new ids index
rows it already has, as there.

Here the tokenizer's side is counted once, torch-free, from tokenizer.json with the same `tokenizers` call
transformers makes (`growth`); `source.with_overrides` then gives the run's architecture the grown vocabulary, so
the plan, the prepared data, the model and the export all see one number (data preparation checks that the
tokenizer transformers loads agrees). The rows themselves come from transformers' own `resize_token_embeddings`:
called on the model by the transformers engine, and for the native engine on transformers' model of the
checkpoint built on the meta device with only its embedding and head real (`added_rows`), under the same seed, so
both engines start from the same rows as transformers resizing the checkpoint itself (tests/distributed/
test_tokens.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapter.config import spell
from adapter.errors import bad


@dataclass(frozen=True)
class Growth:
    """What `tokens:` (and `resize_token_embeddings_to_32x`) do to the vocabulary."""

    tokens: tuple[str, ...]  # as the config lists them
    added: tuple[str, ...]   # those the tokenizer lacked (special_tokens' and tokens'), in the order they get ids
    ids: tuple[int, ...]     # their ids
    tokenizer_len: int       # len(tokenizer) once they are added
    rows: int                # the checkpoint's embedding rows (config.json vocab_size)
    new_rows: int            # rows after resizing (== rows: nothing resized)
    mean: bool               # mean_resizing_embeddings
    specials: tuple[str, ...] = ()  # the new tokens that special_tokens named (a subset of `added`)

    @property
    def resized(self) -> bool:
        return self.new_rows > self.rows

    def note(self, cfg) -> str:
        """The run's first line about it (plan prints it too)."""
        key = spell(cfg, "data.tokens")
        if self.specials:
            key = spell(cfg, "data.special_tokens") + (f" and {key}" if self.tokens else "")
        if not self.tokens and not self.specials:
            what = (f"{spell(cfg, 'data.resize_vocab_to_32x')}: the tokenizer's {self.tokenizer_len} tokens rounded "
                    "up to a multiple of 32")
        elif not self.added:
            return (f"{key}: {', '.join(self.tokens)} already in the vocabulary: nothing added (each is matched whole "
                    "in the text, as Axolotl's add_tokens makes it)")
        else:
            what = f"{key}: {len(self.added)} new token(s) {', '.join(self.added)} (ids {self.ids[0]}..{self.ids[-1]})"
        if not self.resized:
            return (f"{what}: the embedding's {self.rows} rows already cover them, nothing resized (as Axolotl); "
                    "those rows train as they are")
        init = ("the old rows' mean and covariance (mean_resizing_embeddings)" if self.mean else
                "normal(0, initializer_range), Axolotl's default (mean_resizing_embeddings: false)")
        return (f"{what}: embedding and LM head resized {self.rows} -> {self.new_rows} rows by transformers' "
                f"resize_token_embeddings, the new rows drawn from {init} with the run's seed")


def tokenizer_json(tok_dir: Path, cfg) -> Path:
    path = Path(tok_dir) / "tokenizer.json"
    if not path.is_file():
        raise bad(spell(cfg, "data.tokens"), list(cfg.data.tokens), f"counting the vocabulary needs the tokenizer's "
                  f"tokenizer.json, which {tok_dir} lacks", "save the tokenizer with tokenizer.json (a fast tokenizer)")
    return path


def special_tokens(cfg) -> tuple[list[str], list[str]]:
    """(the named special tokens, bos_token ... in Axolotl's order; additional_special_tokens), as the config gives
    them."""
    given = cfg.data.special_tokens.model_dump(exclude_none=True)
    additional = list(given.pop("additional_special_tokens", None) or [])
    return list(given.values()), additional


def growth(cfg, tok_dir: Path, rows: int) -> Growth | None:
    """None when the config adds nothing and asks for no 32x rounding (the tokenizer is then not read).

    Axolotl's order (loaders/tokenizer.py): each named special token (add_special_tokens), then `tokens`
    (add_tokens), then additional_special_tokens; a token the vocabulary has gets no new id."""
    tokens = tuple(cfg.data.tokens)
    named, additional = special_tokens(cfg)
    if not tokens and not named and not additional and not cfg.data.resize_vocab_to_32x:
        return None
    from tokenizers import AddedToken, Tokenizer  # Rust bindings: no torch

    tok = Tokenizer.from_file(str(tokenizer_json(tok_dir, cfg)))
    known = tok.get_vocab(with_added_tokens=True)

    def added_token(t: str, special: bool):
        return AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)

    tok.add_special_tokens([added_token(t, True) for t in named])
    tok.add_tokens([added_token(t, False) for t in tokens])
    tok.add_special_tokens([added_token(t, True) for t in additional])
    added = tuple(dict.fromkeys(t for t in (*named, *tokens, *additional) if t not in known))
    ids = tuple(int(tok.token_to_id(t) or 0) for t in added)  # each was just added: it has an id
    order = sorted(range(len(added)), key=lambda i: ids[i])
    added, ids = tuple(added[i] for i in order), tuple(ids[i] for i in order)
    specials = tuple(t for t in added if t in named or t in additional)
    n = tok.get_vocab_size(with_added_tokens=True)
    target = -(-n // 32) * 32 if cfg.data.resize_vocab_to_32x else n
    if not tokens and not specials and not cfg.data.resize_vocab_to_32x:
        return None  # special tokens the vocabulary has: nothing to say, nothing grows
    return Growth(tokens=tokens, added=added, ids=ids, tokenizer_len=n, rows=rows, new_rows=max(rows, target),
                  mean=cfg.model.mean_resizing_embeddings, specials=specials)


def embedding_modules(model_type: str) -> list[str]:
    """Axolotl's `get_linear_embedding_layers`: the modules its LoRA must save in full when tokens are added."""
    return {"gpt_neox": ["embed_in", "embed_out"], "falcon": ["word_embeddings", "lm_head"],
            "nemotron_h": ["embeddings", "lm_head"]}.get(model_type, ["embed_tokens", "lm_head"])


def check_lora(cfg, model_type: str, grew: Growth | None = None) -> None:
    """Axolotl's rule (loaders/tokenizer.py): an adapter run that adds tokens (`tokens`, or new special tokens other
    than the pad token) must list the embedding and the LM head in lora_modules_to_save, else the new rows would
    never train (they are frozen base rows). `grew`: what growth() found."""
    if cfg.lora is None:
        return
    pad = cfg.data.special_tokens.pad_token
    trained_specials = [t for t in (grew.specials if grew is not None else ()) if t != pad]  # pad rows never train
    if not cfg.data.tokens and not trained_specials:
        return
    need = embedding_modules(model_type)
    have = list(cfg.lora.modules_to_save or [])
    if not all(m in have for m in need):
        raise bad(spell(cfg, "lora.modules_to_save"), have, "adding tokens with an adapter needs the embedding and "
                  "LM head trained in full (Axolotl refuses it too)", f"set it to {need}")


def added_rows(config: dict[str, Any], embed, head, new_rows: int, *, mean: bool, seed: int,
               trust_remote_code: bool = False, model_dir: str | None = None):
    """(embedding rows, head rows or None when tied) that transformers' `resize_token_embeddings(new_rows,
    mean_resizing=mean)` appends to `embed` [rows, hidden] and `head` [rows, hidden] (None: tied) under
    `torch.manual_seed(seed)`: its own code on its own model class, built on the meta device with only these two
    modules real, so the draws (the new modules' constructors, then `_init_weights` or the mean/covariance sample)
    are exactly the ones it makes on the whole model. The global RNG is left as it was."""
    import torch

    from adapter.models.generic import meta_model

    model, _ = meta_model(config, trust_remote_code=trust_remote_code, model_dir=model_dir)
    rows, hidden = embed.shape
    emb = torch.nn.Embedding(rows, hidden, dtype=embed.dtype, device="cpu", _weight=embed.detach().cpu().clone())
    model.set_input_embeddings(emb)
    lin = torch.nn.Linear(hidden, rows, bias=False, dtype=embed.dtype, device="meta")
    # tied: the head's weight is the embedding's own Parameter, as in the tied model, so resizing the embedding
    # resizes it too and transformers draws nothing for it
    lin.weight = emb.weight if head is None else torch.nn.Parameter(head.detach().cpu().clone())
    model.set_output_embeddings(lin)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.resize_token_embeddings(new_rows, mean_resizing=mean)
    new_embed = model.get_input_embeddings().weight.data[rows:]
    new_head = model.get_output_embeddings().weight.data[rows:] if head is not None else None
    return new_embed, new_head


def resize_hf(model, g: Growth | None, *, seed: int) -> None:
    """The transformers engine: transformers' `resize_token_embeddings` on the model itself, under the seed
    `added_rows` uses (the global RNG left as it was)."""
    import torch

    if g is None or not g.resized:
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.resize_token_embeddings(g.new_rows, mean_resizing=g.mean)


def config_dict(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


__all__ = ["Growth", "growth", "check_lora", "embedding_modules", "added_rows", "resize_hf"]
