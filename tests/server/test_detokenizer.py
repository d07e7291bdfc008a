"""Incremental detokenizer against the real byte-level tokenizer: streamed text must equal the full decode."""

from __future__ import annotations

import random

import pytest

from minisgl.server.detokenizer import IncrementalDetokenizer, TextDelta
from minisgl.tools.tiny_model import train_tokenizer

TEXT = "Hello, world! Café crème, naïve façade. 你好，世界。 Emoji: 🙂👍🏽 done. The end."
CAPITALS = "Paris is the capital of France, and Berlin is the capital of Germany."


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def stream(tok, chunks, stop=(), skip_special_tokens=True
           ) -> tuple[list[TextDelta], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, stop=stop, skip_special_tokens=skip_special_tokens)
    deltas = []
    for chunk in chunks:
        deltas.append(detok.add(chunk))
        if deltas[-1].stopped:
            break
    return deltas, detok.flush(), detok


def streamed_text(deltas, tail) -> str:
    return "".join(d.text for d in deltas) + tail


def expected(tok, ids, stop=(), skip_special_tokens=True) -> tuple[str, bool]:
    """The full decode cut before the stop occurrence that completes first (ties: the one starting first)."""
    text = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    found = [(i + len(s), i) for s in stop if s and (i := text.find(s)) >= 0]
    return (text[:min(found)[1]], True) if found else (text, False)


def one_by_one(ids) -> list[list[int]]:
    return [[i] for i in ids]


def random_chunks(ids, rng: random.Random) -> list[list[int]]:
    chunks, pos = [], 0
    while pos < len(ids):
        n = rng.randint(0, 5)  # empty adds happen too
        chunks.append(ids[pos:pos + n])
        pos += n
    return chunks


def test_token_by_token_holds_incomplete_characters(tok):
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.encode()) // 3  # multi-byte characters really span several tokens
    deltas, tail, detok = stream(tok, one_by_one(ids))
    assert all("\ufffd" not in d.text for d in deltas)
    assert any(d.text == "" for d in deltas)  # something was held back until its character completed
    assert not any(d.stopped for d in deltas)
    assert tail == ""
    assert streamed_text(deltas, tail) == detok.text == tok.decode(ids) == TEXT


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks(tok, seed):
    ids = tok.encode(TEXT)
    deltas, tail, detok = stream(tok, random_chunks(ids, random.Random(seed)))
    assert all("\ufffd" not in d.text for d in deltas)
    assert streamed_text(deltas, tail) == detok.text == TEXT


def test_decode_window_stays_short(tok):
    """Each step decodes a few recent ids, never the whole output."""

    class CountingTokenizer:
        def __init__(self):
            self.longest = 0

        def decode(self, ids, skip_special_tokens):
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = CountingTokenizer()
    ids = tok.encode(TEXT * 10)
    detok = IncrementalDetokenizer(counting)
    text = "".join(detok.add([i]).text for i in ids) + detok.flush()
    assert text == TEXT * 10
    assert counting.longest <= 8


def test_stop_across_token_boundary(tok):
    ids = tok.encode(CAPITALS)
    pieces = [tok.decode([i]) for i in ids]
    stop = pieces[6][-2:] + pieces[7][:3]  # " of" + " France" -> "of Fr"
    assert stop == "of Fr" and CAPITALS.find(stop) == len("".join(pieces[:7])) - 2
    deltas, tail, detok = stream(tok, one_by_one(ids), stop=[stop])
    assert deltas[-1].stopped and len(deltas) == 8  # found on the token that completes it
    assert tail == ""
    assert detok.text == "Paris is the capital "


def test_stop_across_two_add_calls(tok):
    ids = tok.encode(CAPITALS)
    detok = IncrementalDetokenizer(tok, stop=["capital of Germany"])
    first = detok.add(ids[:18])  # ends with "... Berlin is the capital of"
    assert not first.stopped and first.text == "Paris is the capital of France, and Berlin is the "
    second = detok.add(ids[18:])
    assert second == TextDelta("", True)
    assert detok.add(ids[:2]) == TextDelta("", True)  # late tokens after the stop are dropped
    assert detok.flush() == ""
    assert detok.text == "Paris is the capital of France, and Berlin is the "


def test_multiple_stops_earliest_wins(tok):
    ids = tok.encode(CAPITALS)
    deltas, _, detok = stream(tok, one_by_one(ids), stop=["Germany", "France", "Berlin"])
    assert deltas[-1].stopped and detok.text == "Paris is the capital of "
    # one big add sees every stop string at once and still cuts at the earliest
    deltas, _, detok = stream(tok, [ids], stop=["Germany", "Berlin", "France"])
    assert deltas == [TextDelta("Paris is the capital of ", True)]


def test_overlapping_stops_first_completed_wins(tok):
    """"is" completes (in "Paris") before "Paris is" does; the result does not depend on chunking."""
    ids = tok.encode(CAPITALS)
    for chunks in (one_by_one(ids), [ids]):
        _, _, detok = stream(tok, chunks, stop=["Paris is", "is"])
        assert detok.text == "Par"


def test_stop_prefix_held_then_released(tok):
    ids = tok.encode(CAPITALS)
    detok = IncrementalDetokenizer(tok, stop=["capital of Germany"])
    texts = [detok.add([i]).text for i in ids[:8]]  # through " France"
    assert texts[5:8] == [" ", "", "capital of France"]  # "capital", " of" held: they could start the stop
    assert detok.text == "Paris is the capital of France"
    rest = [detok.add([i]) for i in ids[8:]]
    assert rest[-1].stopped and detok.text == "Paris is the capital of France, and Berlin is the "


def test_prefix_never_completed_is_flushed(tok):
    ids = tok.encode(CAPITALS)
    detok = IncrementalDetokenizer(tok, stop=["Germany!"])
    streamed = "".join(detok.add([i]).text for i in ids)
    assert streamed == CAPITALS  # "Germany" was held until "." diverged from the stop string
    ids2 = ids[:-1]  # now end on the held prefix: the request ends by length
    detok = IncrementalDetokenizer(tok, stop=["Germany!"])
    streamed = "".join(detok.add([i]).text for i in ids2)
    assert streamed == CAPITALS[:-len("Germany.")]
    assert detok.flush() == "Germany"
    assert detok.text == CAPITALS[:-1]


def test_stop_at_first_token(tok):
    ids = tok.encode(CAPITALS)
    detok = IncrementalDetokenizer(tok, stop=["P"])
    assert detok.add(ids[:1]) == TextDelta("", True)
    assert detok.add(ids[1:]) == TextDelta("", True)
    assert detok.flush() == "" and detok.text == ""


def test_empty_stop_strings_are_ignored(tok):
    ids = tok.encode(TEXT)
    deltas, _, detok = stream(tok, one_by_one(ids), stop=["", ""])
    assert detok.text == TEXT and not any(d.stopped for d in deltas)


@pytest.mark.parametrize("stop, before", [("你好", "Hello, world! Café crème, naïve façade. "),
                                          ("é", "Hello, world! Caf"),
                                          ("🙂", "Hello, world! Café crème, naïve façade. 你好，世界。 Emoji: "),
                                          ("👍🏽 d", "Hello, world! Café crème, naïve façade. 你好，世界。 Emoji: 🙂"),
                                          ("世界。 X", None)])
def test_non_ascii_stops(tok, stop, before):
    ids = tok.encode(TEXT)
    for chunks in (one_by_one(ids), random_chunks(ids, random.Random(1))):
        deltas, tail, detok = stream(tok, chunks, stop=[stop])
        assert all("\ufffd" not in d.text for d in deltas)
        if before is None:  # a prefix matched for a while, then diverged
            assert detok.text == TEXT and not deltas[-1].stopped
        else:
            assert deltas[-1].stopped and tail == "" and detok.text == before


def test_special_tokens(tok):
    im_start, im_end, eos = 1, 2, 0
    ids = [im_start] + tok.encode("Hi ") + tok.encode("🙂")[:2] + [im_end] + tok.encode("🙂")[2:] + [eos]
    deltas, tail, _ = stream(tok, one_by_one(ids))
    assert streamed_text(deltas, tail) == tok.decode(ids, skip_special_tokens=True) == "Hi 🙂"
    deltas, tail, _ = stream(tok, one_by_one(ids), skip_special_tokens=False)
    text = streamed_text(deltas, tail)
    assert text == tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>Hi ") and "<|im_end|>" in text and text.endswith("<|endoftext|>")


def test_special_token_as_stop_string(tok):
    ids = tok.encode("Hi there") + [2] + tok.encode(" more")
    _, _, detok = stream(tok, one_by_one(ids), stop=["<|im_end|>"], skip_special_tokens=False)
    assert detok.text == "Hi there"


def test_flush_incomplete_utf8_tail(tok):
    emoji = tok.encode("🙂")
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("ok ")).text == "ok "
    assert detok.add(emoji[:1]) == TextDelta("", False)
    tail = detok.flush()
    assert tail == tok.decode(emoji[:1]) and "\ufffd" in tail
    assert detok.text == "ok " + tail


def test_random_sequences_match_truncated_full_decode(tok):
    rng = random.Random(1234)
    words = [TEXT, CAPITALS, " naïve 你好 🙂👍🏽", "<|im_end|>", "abc abd abe"]
    pieces = [tok.encode(w) for w in words]
    stops_seen = 0
    for _ in range(400):
        ids: list[int] = []
        while len(ids) < rng.randint(1, 40):
            if rng.random() < 0.4:  # any token: bytes that may form invalid UTF-8, special tokens
                ids.append(rng.randrange(len(tok)))
            else:
                piece = rng.choice(pieces)
                start = rng.randrange(len(piece))
                ids.extend(piece[start:start + rng.randint(1, 6)])
        skip = rng.random() < 0.7
        full = tok.decode(ids, skip_special_tokens=skip)
        stop = []
        for _ in range(rng.randint(0, 3)):
            if full and rng.random() < 0.8:
                start = rng.randrange(len(full))
                stop.append(full[start:start + rng.randint(1, 6)])
            else:
                stop.append(rng.choice(["zz", "é!", "🙂x", ""]))
        chunks = one_by_one(ids) if rng.random() < 0.5 else random_chunks(ids, rng)
        deltas, tail, detok = stream(tok, chunks, stop=stop, skip_special_tokens=skip)
        want, want_stopped = expected(tok, ids, stop, skip)
        assert streamed_text(deltas, tail) == detok.text == want, (ids, stop, skip)
        assert detok.stopped == want_stopped  # flush may find a stop string ending in a held incomplete tail
        stops_seen += want_stopped
    assert stops_seen > 100
