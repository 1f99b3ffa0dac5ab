import json

import numpy as np
import pytest
import tokenizers

from steadylm.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    get_tokenizer,
    load_tokenizer,
    save_tokenizer,
    train_bpe,
)
from steadylm.errors import DataError, SteadyError

TEXT = "def f(x):\n    return 'héllo ∑ 🐍'\n\t  \r\nclass A: pass  # <|endoftext|> inside text\n"


def test_bytes_round_trip_unicode_and_eos():
    tok = get_tokenizer("bytes")
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("bytes", 257, 256)
    ids = tok.encode(TEXT)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids + [tok.eos_id] + ids) == TEXT + TEXT  # eos is skipped


def test_bytes_decode_invalid_utf8_replaces():
    assert ByteTokenizer().decode([0xE2, 0x82]) == "\ufffd"


def test_bytes_tokenizer_json_is_a_hugging_face_tokenizer_with_the_same_ids(tmp_path):
    path = save_tokenizer(ByteTokenizer(), tmp_path)
    hf = tokenizers.Tokenizer.from_file(str(path))
    plain = TEXT.replace("<|endoftext|>", "")  # HF maps the literal special string to eos, as for GPT-2
    assert hf.encode(plain).ids == ByteTokenizer().encode(plain)
    assert hf.get_vocab_size() == 257 and hf.token_to_id("<|endoftext|>") == 256
    assert hf.decode(ByteTokenizer().encode(plain)) == plain
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer) and tok.path == path
    assert tok.token_bytes().tolist() == [1] * 256 + [0]


def test_bytes_tokenizer_json_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    save_tokenizer(ByteTokenizer(), tmp_path)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), eos_token="<|endoftext|>"
    )
    plain = TEXT.replace("<|endoftext|>", "")
    assert fast.encode(plain, add_special_tokens=False) == list(plain.encode())
    assert fast.eos_token_id == 256


def test_unknown_name_lists_valid_specs():
    with pytest.raises(SteadyError, match="bytes, bpe, a path to a tokenizer.json, or a tiktoken name"):
        get_tokenizer("sentencepiece")
    with pytest.raises(SteadyError, match="trained by prepare"):
        get_tokenizer("bpe")
    with pytest.raises(SteadyError, match="nope.json: tokenizer file not found"):
        get_tokenizer("nope.json")


def test_legacy_short_tokenizer_json_still_loads(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"name": "bytes", "vocab_size": 257, "eos_id": 256}))
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


def test_load_missing_or_mismatched(tmp_path):
    with pytest.raises(SteadyError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"name": "bytes", "vocab_size": 300, "eos_id": 256}')
    with pytest.raises(SteadyError, match="do not match"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')
    with pytest.raises(DataError, match="tokenizer.json: not a loadable tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.fixture(scope="module")
def bpe():
    texts = [f"def function_{i}(value):\n    return value + {i}\n" for i in range(300)] + ["héllo wörld 🐍"] * 20
    return train_bpe(texts, vocab_size=400)


def test_bpe_trains_offline_with_eos_and_round_trips(bpe, tmp_path):
    assert bpe.vocab_size == 400 and bpe.eos_id == 0
    ids = bpe.encode(TEXT)
    assert len(ids) < len(TEXT.encode())  # merges learned
    assert bpe.decode(ids) == TEXT
    assert bpe.eos_id not in ids  # the literal "<|endoftext|>" in a document is text, not the separator
    # token_bytes: the UTF-8 bytes behind each id, exact for a byte-level vocabulary
    assert int(bpe.token_bytes()[ids].sum()) == len(TEXT.encode())
    path = save_tokenizer(bpe, tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, HFTokenizer) and again.path == path and again.encode(TEXT) == ids
    assert tokenizers.Tokenizer.from_file(str(path)).decode(ids) == TEXT


def test_bpe_training_is_deterministic(bpe):
    texts = [f"def function_{i}(value):\n    return value + {i}\n" for i in range(300)] + ["héllo wörld 🐍"] * 20
    assert train_bpe(texts, vocab_size=400).to_hf().to_str() == bpe.to_hf().to_str()


def test_a_tokenizer_json_path_is_a_tokenizer(bpe, tmp_path):
    path = save_tokenizer(bpe, tmp_path)
    tok = get_tokenizer(str(path))
    assert tok.encode(TEXT) == bpe.encode(TEXT) and tok.eos_id == 0


def test_a_tokenizer_without_end_of_text_is_refused(tmp_path):
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tk.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match="tokenizer.json: tokenizer has no end-of-text token"):
        load_tokenizer(tmp_path)


def test_bpe_vocab_too_small():
    with pytest.raises(SteadyError, match="data.vocab_size=100 is too small"):
        train_bpe(["x"], vocab_size=100)


def test_tiktoken_needs_the_extra_or_works():
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        with pytest.raises(SteadyError, match="pip install tiktoken"):
            get_tokenizer("gpt2")
        return
    try:
        tok = get_tokenizer("gpt2")
    except SteadyError as e:  # installed but offline
        assert "network" in str(e)
        return
    assert (tok.vocab_size, tok.eos_id) == (50257, 50256)
    assert tok.decode(tok.encode("hello world") + [tok.eos_id]) == "hello world"
    assert isinstance(tok.token_bytes(), np.ndarray)


def test_tokenizer_of_run_loads_bpe_from_the_runs_data_dir(bpe, tmp_path):
    from steadylm.data.tokenizer import tokenizer_of_run

    assert isinstance(tokenizer_of_run({"tokenizer": "bytes"}), ByteTokenizer)
    save_tokenizer(bpe, tmp_path)
    tok = tokenizer_of_run({"tokenizer": "bpe", "config": {"data": {"dir": str(tmp_path)}}})
    assert tok.encode(TEXT) == bpe.encode(TEXT)
    with pytest.raises(SteadyError, match="tokenizer.json, which is missing"):
        tokenizer_of_run({"tokenizer": "bpe", "config": {"data": {"dir": str(tmp_path / "gone")}}})
