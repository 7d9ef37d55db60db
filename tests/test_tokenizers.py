"""Our tokenizers (the `tokenizers` engine over the checkpoint's tokenizer.json files) against
transformers' PreTrainedTokenizerFast, which the reference uses: same ids, offsets and decoded text."""

from __future__ import annotations

import json

import pytest

from minicpm_cli.engine.text import Tokenizers, read_prompt

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tiny_dir):
    from transformers import PreTrainedTokenizerFast

    ours = Tokenizers(tiny_dir)
    llm = PreTrainedTokenizerFast(tokenizer_file=str(tiny_dir / "tokenizer.json"), clean_up_tokenization_spaces=False)
    bert = PreTrainedTokenizerFast(tokenizer_file=str(tiny_dir / "assets/chattts_tokenizer/tokenizer.json"),
                                   clean_up_tokenization_spaces=True)
    return ours, llm, bert


def _texts(tiny_dir) -> list[str]:
    manifest = json.loads((tiny_dir.parent / "manifest.json").read_text())
    found = []

    def walk(x):
        if isinstance(x, str) and 3 < len(x) < 2000:
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(manifest)
    extra = ["Hi, how are you?", "It's 3.5 km - isn't it?  Yes!! (really) \"quoted\" 'single' we've they're I'm",
             "naïve café, Straße; 東京 and 😀 emoji", "Numbers: 1,234,567.89 and 10% off", " leading and trailing ",
             "<|im_start|>user\nHello<|im_end|>", "[Stts][spk_emb] hello [Etts][PAD][Ptts]", "a\n\nb\tc", ""]
    return sorted(set(found))[:200] + extra


def test_encode_decode_and_offsets_match_transformers(pair, tiny_dir):
    ours, llm, bert = pair
    texts = _texts(tiny_dir)
    assert len(texts) > 20
    for t in texts + [read_prompt(t) for t in texts[:20]]:
        ids = llm.encode(t, add_special_tokens=False)
        assert ours.encode_llm(t) == ids, t
        assert ours.llm.decode(ids) == llm.decode(ids), t
        bids = bert.encode(t, add_special_tokens=False)
        assert ours.encode_bert(t) == bids, t
        assert ours.bert.decode(bids) == bert.decode(bids), t
        want = bert(t, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        assert [tuple(o) for o in ours.bert_offsets(t)] == [tuple(o) for o in want], t


def test_special_token_ids_match_transformers(pair):
    ours, llm, bert = pair
    for token in ("<|spk|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|tts_eos|>"):
        assert ours.llm.convert_tokens_to_ids(token) == llm.convert_tokens_to_ids(token)
    for token in ("[Stts]", "[spk_emb]", "[Etts]", "[Ptts]", "[PAD]"):
        assert ours.bert.convert_tokens_to_ids(token) == bert.convert_tokens_to_ids(token)
    assert len(ours.llm) == len(llm) and len(ours.bert) == len(bert)
    assert ours.bert.convert_ids_to_tokens(ours.bert.unk_token_id) == "[UNK]"  # (transformers: none without the map)


def test_cleanup_joins_spaces_before_punctuation_in_bert_only(pair):
    ours, _, bert = pair
    ids = bert.encode("it is , isn't it ?", add_special_tokens=False)
    assert " ," not in ours.bert.decode(ids) and " ?" not in ours.bert.decode(ids)
