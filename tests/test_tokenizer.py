import json

import pytest

from steadylm.data.tokenizer import ByteTokenizer, get_tokenizer, load_tokenizer, save_tokenizer
from steadylm.errors import SteadyError


def test_bytes_round_trip_unicode_and_eos():
    tok = get_tokenizer("bytes")
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("bytes", 257, 256)
    text = "def f(x):\n    return 'héllo ∑ 🐍'\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id] + ids) == text + text  # eos is skipped


def test_bytes_decode_invalid_utf8_replaces():
    assert ByteTokenizer().decode([0xE2, 0x82]) == "\ufffd"


def test_unknown_name_lists_valid_names():
    with pytest.raises(SteadyError, match="bytes.*gpt2"):
        get_tokenizer("sentencepiece")


def test_save_and_load(tmp_path):
    tok = ByteTokenizer()
    path = save_tokenizer(tok, tmp_path)
    assert json.loads(path.read_text()) == {"name": "bytes", "vocab_size": 257, "eos_id": 256}
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(path), ByteTokenizer)
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


def test_load_missing_or_mismatched(tmp_path):
    with pytest.raises(SteadyError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"name": "bytes", "vocab_size": 300, "eos_id": 256}')
    with pytest.raises(SteadyError, match="do not match"):
        load_tokenizer(tmp_path)


def test_gpt2_needs_tiktoken_or_works():
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
