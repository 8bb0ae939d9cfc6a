"""kinfer_rpc.framing on bytes in memory: frames in, messages and FrameErrors out."""

from __future__ import annotations

import json

import anyio
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kinfer_rpc import errors
from kinfer_rpc.protocol.framing import MAX_FRAME_BYTES, FrameError, FrameReader, encode

PARSE_ERROR = errors.PARSE_ERROR
INVALID_REQUEST = errors.INVALID_REQUEST


class Chunks:
    """A byte stream that returns the given chunks one by one, then ends."""

    def __init__(self, chunks, end_with_exception: bool = True):
        self.chunks = [bytes(c) for c in chunks if c]
        self.end_with_exception = end_with_exception
        self.reads = 0

    async def receive(self) -> bytes:
        self.reads += 1
        if not self.chunks:
            if self.end_with_exception:
                raise anyio.EndOfStream
            return b""
        return self.chunks.pop(0)


def read_all(chunks, max_frame: int = MAX_FRAME_BYTES, limit: int = 200, **kw) -> list:
    """Everything the reader yields (at most `limit` items, so that a reader stuck in a loop fails a test
    instead of hanging it)."""

    async def go():
        out = []
        async for m in FrameReader(Chunks(chunks, **kw), max_frame):
            out.append(m)
            if len(out) >= limit:
                break
        return out

    return anyio.run(go)


def read(data: bytes, **kw) -> list:
    return read_all([data], **kw)


def msg(i, method="model/list"):
    return {"jsonrpc": "2.0", "id": i, "method": method, "params": {"text": f"héllo ✓ {i}"}}


def errors_of(items):
    return [x for x in items if isinstance(x, FrameError)]


def messages_of(items):
    return [x for x in items if not isinstance(x, FrameError)]


GOOD = encode(msg(99))


# -- good frames ---------------------------------------------------------------------------


def test_encode_is_content_length_then_utf8_json():
    m = msg(1)
    data = encode(m)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head == b"Content-Length: %d" % len(body)
    assert json.loads(body.decode("utf-8")) == m
    assert "✓".encode() in body  # not \u-escaped: the length counts UTF-8 bytes


def test_empty_stream_yields_nothing():
    assert read(b"") == []


def test_one_frame():
    assert read(encode(msg(1))) == [msg(1)]


@pytest.mark.parametrize("end_with_exception", [True, False])
def test_stream_end_by_exception_or_empty_read(end_with_exception):
    assert read_all([encode(msg(1))], end_with_exception=end_with_exception) == [msg(1)]


def test_two_frames_split_at_every_byte_boundary():
    data = encode(msg(1)) + encode(msg(2))
    for i in range(len(data) + 1):
        assert read_all([data[:i], data[i:]]) == [msg(1), msg(2)], f"split at {i}"


def test_frames_split_at_every_pair_of_boundaries():
    data = encode(msg(1)) + encode(msg(2))
    for i in range(0, len(data) + 1, 3):
        for j in range(i, len(data) + 1, 7):
            assert read_all([data[:i], data[i:j], data[j:]]) == [msg(1), msg(2)], f"split at {i}, {j}"


def test_one_byte_at_a_time():
    data = encode(msg(1)) + encode(msg(2)) + encode(msg(3))
    assert read_all([data[i : i + 1] for i in range(len(data))]) == [msg(1), msg(2), msg(3)]


def test_many_frames_in_one_chunk():
    data = b"".join(encode(msg(i)) for i in range(50))
    assert read(data) == [msg(i) for i in range(50)]


@pytest.mark.parametrize(
    "content_type",
    [
        b"application/vscode-jsonrpc; charset=utf-8",
        b"application/vscode-jsonrpc; charset=UTF-8",
        b"application/vscode-jsonrpc; charset=utf8",
        b'application/vscode-jsonrpc; charset="utf-8"',
        b"application/vscode-jsonrpc",
    ],
)
@pytest.mark.parametrize("order", ["length-first", "type-first"])
def test_content_type_utf8_is_accepted(content_type, order):
    body = json.dumps(msg(1)).encode()
    length = b"Content-Length: %d\r\n" % len(body)
    ctype = b"Content-Type: " + content_type + b"\r\n"
    headers = length + ctype if order == "length-first" else ctype + length
    assert read(headers + b"\r\n" + body + GOOD) == [msg(1), msg(99)]


def test_header_names_are_case_insensitive_and_values_trimmed():
    body = json.dumps(msg(1)).encode()
    assert read(b"content-length:   %d  \r\n\r\n" % len(body) + body) == [msg(1)]


def test_unknown_headers_are_ignored():
    body = json.dumps(msg(1)).encode()
    assert read(b"Content-Length: %d\r\nX-Anything: 1\r\n\r\n" % len(body) + body) == [msg(1)]


# -- bad frames: an error, then the next frame -------------------------------------------


@pytest.mark.parametrize("charset", [b"latin-1", b"utf-16", b"ascii", b"iso-8859-1"])
def test_bad_charset_is_refused_and_the_next_frame_read(charset):
    body = json.dumps(msg(1)).encode()
    data = b"Content-Length: %d\r\nContent-Type: application/vscode-jsonrpc; charset=%s\r\n\r\n" % (len(body), charset)
    out = read(data + body + GOOD)
    assert len(out) == 2, out
    assert isinstance(out[0], FrameError) and out[0].code == PARSE_ERROR
    assert "charset" in out[0].message
    assert out[1] == msg(99)


def test_bad_charset_before_content_length_is_refused_once():
    body = json.dumps(msg(1)).encode()
    data = b"Content-Type: application/vscode-jsonrpc; charset=latin-1\r\nContent-Length: %d\r\n\r\n" % len(body)
    out = read(data + body + GOOD)
    assert [type(x).__name__ for x in out] == ["FrameError", "dict"], out
    assert out[1] == msg(99)


def test_missing_content_length():
    body = json.dumps(msg(1)).encode()
    out = read(b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\n\r\n" + body + GOOD)
    assert len(out) == 2 and out[0].code == PARSE_ERROR and "Content-Length" in out[0].message
    assert out[1] == msg(99)


@pytest.mark.parametrize("value", [b"abc", b"-5", b"+5", b"1e3", b"0x10", b"", b"5 5", b"\xd9\xa3"])
def test_non_numeric_content_length(value):
    out = read(b"Content-Length: " + value + b"\r\n\r\n{}" + GOOD)
    assert len(out) == 2, out
    assert isinstance(out[0], FrameError) and out[0].code == PARSE_ERROR
    assert out[1] == msg(99)


def test_header_line_without_colon():
    out = read(b"Content-Length: 2\r\nnonsense\r\n\r\n{}" + GOOD)
    assert len(out) == 2 and out[0].code == PARSE_ERROR and "malformed header" in out[0].message
    assert out[1] == msg(99)


def test_non_ascii_headers():
    out = read(b"Content-L\xe9ngth: 2\r\n\r\n{}" + GOOD)
    assert len(out) == 2 and out[0].code == PARSE_ERROR and "ASCII" in out[0].message
    assert out[1] == msg(99)


@pytest.mark.parametrize("body", [b"\xff\xfe{}", b'{"a": "\xc3"}', b'{"a": "\xed\xa0\x80"}'])
def test_non_utf8_body(body):
    out = read(encode_raw(body) + GOOD)
    assert len(out) == 2 and out[0].code == PARSE_ERROR and "UTF-8" in out[0].message
    assert out[1] == msg(99)


@pytest.mark.parametrize("body", [b"", b"{", b"not json", b'{"a": 1,}', b"{}{}", b"'single'", b"\x00"])
def test_non_json_body(body):
    out = read(encode_raw(body) + GOOD)
    assert len(out) == 2 and out[0].code == PARSE_ERROR and "JSON" in out[0].message
    assert out[1] == msg(99)


def test_deeply_nested_body_is_a_parse_error_not_a_crash():
    out = read(encode_raw(b"[" * 100000 + b"]" * 100000) + GOOD)
    assert len(out) == 2 and out[0].code == PARSE_ERROR
    assert out[1] == msg(99)


DEEP = b"[" * 3000 + b"]" * 3000


@pytest.mark.parametrize(
    "body,rid",
    [
        (b'{"jsonrpc":"2.0","id":"d","method":"model/list","params":{"a":' + DEEP + b"}}", "d"),
        (b'{"params":' + DEEP + b',"method":"m","jsonrpc":"2.0","id":7}', 7),  # the id after the deep part
        (b'{"id":null,"method":"m","params":[' + DEEP + b"]}", None),
        (b'{"id":8,"method":"m","x":{"s":"]]}}\\"[[","y":' + DEEP + b"}}", 8),  # brackets in strings
        (b'{"id":9,"method":"m","params":{"n":' + b"7" * 5000 + b"}}", 9),  # a number too long
    ],
)
def test_a_request_too_deep_for_the_parser_is_answered_with_its_id(body, rid):
    """Well-formed JSON that json.loads cannot take (nested past its recursion limit, a number
    past int()'s digits) is -32700 with the request's id, read from the top level, so that the
    client is not left waiting; the next frame is read as usual."""
    out = read(encode_raw(body) + GOOD)
    assert len(out) == 2 and out[0].code == PARSE_ERROR
    assert out[0].id == rid and out[0].has_id
    assert out[1] == msg(99)


@pytest.mark.parametrize(
    "body",
    [
        b'{"jsonrpc":"2.0","method":"m","params":' + DEEP + b"}",  # a notification
        b'{"jsonrpc":"2.0","id":1,"result":' + DEEP + b"}",  # a response: never answered with its id
        b'{"id":[1],"method":"m","params":' + DEEP + b"}",  # an id no request can have
        b'{"id":true,"method":"m","params":' + DEEP + b"}",
        b'{"id":1,"method":"m","params":' + b"[" * 3000 + b"]" * 2999 + b"}",  # not JSON after all
        b'{"id":1,"method":"m","params":' + DEEP + b"]}",
        b"[" + DEEP + b"]",
    ],
)
def test_a_body_too_deep_without_a_request_id_is_answered_with_id_null(body):
    out = read(encode_raw(body) + GOOD)
    assert len(out) == 2 and out[0].code == PARSE_ERROR and out[0].id is None and not out[0].has_id
    assert out[1] == msg(99)


def test_skipping_a_deep_value_gives_up_on_a_pathological_body():
    """Skipping what json cannot read takes a bounded number of steps: past it the id is not
    sought (60 MB of brackets in under a second)."""
    body = b'{"method":"m","params":[' + b"[" * 2000 + b"[]," * 20_000_000 + b"]" * 2001 + b',"id":5}'
    out = read(encode_raw(body) + GOOD)
    assert out[0].code == PARSE_ERROR and out[0].id is None
    assert out[1] == msg(99)


def test_huge_integer_literal_is_a_parse_error_not_a_crash():
    out = read(encode_raw(b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"n":' + b"1" * 5000 + b"}}") + GOOD)
    assert len(out) == 2 and isinstance(out[0], FrameError)
    assert out[1] == msg(99)


@pytest.mark.parametrize("batch", [[msg(1), msg(2)], [], [msg(1)]])
def test_batch_is_refused(batch):
    out = read(encode(batch) + GOOD)
    assert len(out) == 2
    assert isinstance(out[0], FrameError) and out[0].code == INVALID_REQUEST and "batch" in out[0].message
    assert out[1] == msg(99)


@pytest.mark.parametrize("value", [42, "text", None, True, 1.5])
def test_body_that_is_not_an_object(value):
    out = read(encode(value) + GOOD)
    assert len(out) == 2 and out[0].code == INVALID_REQUEST
    assert out[1] == msg(99)


def test_frame_errors_carry_no_id():
    # The framing never knows the id of a message it could not parse.
    out = read(encode_raw(b'{"jsonrpc":"2.0","id":7,') + encode([msg(1)]))
    assert all(isinstance(x, FrameError) and x.id is None for x in out)


# -- oversize --------------------------------------------------------------------------------


def test_oversize_frame_is_skipped_and_the_next_read():
    big = encode({"jsonrpc": "2.0", "id": 1, "method": "x", "params": {"pad": "x" * 500}})
    out = read(big + GOOD, max_frame=100)
    assert len(out) == 2, out
    assert isinstance(out[0], FrameError) and out[0].code == INVALID_REQUEST
    assert "limit of 100 bytes" in out[0].message
    assert out[1] == msg(99)


def test_oversize_frame_arriving_in_small_chunks_is_skipped():
    big = encode({"jsonrpc": "2.0", "id": 1, "method": "x", "params": {"pad": "é" * 3000}})
    data = big + GOOD
    out = read_all([data[i : i + 97] for i in range(0, len(data), 97)], max_frame=1000)
    assert [type(x) for x in out] == [FrameError, dict]
    assert out[1] == msg(99)


def test_frame_exactly_at_the_limit_is_read():
    data = encode(msg(1))
    body_len = len(data.partition(b"\r\n\r\n")[2])
    assert read(data, max_frame=body_len) == [msg(1)]
    assert isinstance(read(data, max_frame=body_len - 1)[0], FrameError)


def test_oversize_frame_cut_short_by_eof_ends_quietly():
    out = read(b"Content-Length: 5000\r\n\r\n" + b"x" * 100, max_frame=1000)
    assert len(out) == 1 and out[0].code == INVALID_REQUEST


# -- garbage and resynchronisation ----------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        b"garbage",
        b"garbage\r\n",
        b"garbage\r\n\r\n",
        b"\x00\xff\xfe binary \x80",
        b"{}\r\n\r\n",
        b"Content-Length: \r\n\r\n",
        b'Content-Type: text/plain\r\n\r\n{"x": 1}',
        b"\r\n\r\n\r\n",
    ],
)
def test_garbage_then_resync_to_a_valid_frame(garbage):
    out = read(garbage + GOOD + encode(msg(100)))
    assert messages_of(out) == [msg(99), msg(100)], out
    assert all(e.code == PARSE_ERROR for e in errors_of(out))
    assert errors_of(out), "garbage must be reported"


def test_garbage_without_blank_line_longer_than_header_limit():
    out = read(b"x" * 20000 + GOOD)
    assert messages_of(out) == [msg(99)]
    assert errors_of(out)


def test_long_garbage_in_small_chunks_then_resync():
    data = b"\x01garbage-without-crlf " * 1000 + GOOD
    out = read_all([data[i : i + 50] for i in range(0, len(data), 50)])
    assert messages_of(out) == [msg(99)]
    assert errors_of(out)


@pytest.mark.parametrize("garbage", [b"Content-Length: x\r\n\r\n", b"garbage\r\n\r\n", b"g" * 100 + b"\r\n\r\n"])
def test_bad_header_block_arriving_alone_then_resync_in_a_later_read(garbage):
    out = read_all([garbage, GOOD])
    assert messages_of(out) == [msg(99)], out[:3]
    assert len(errors_of(out)) == 1


def test_lf_only_frame_is_not_a_frame():
    body = json.dumps(msg(1)).encode()
    out = read(b"Content-Length: %d\n\n" % len(body) + body + GOOD)
    assert messages_of(out) == [msg(99)]
    assert errors_of(out)


# -- truncation at EOF -------------------------------------------------------------------------


def test_truncated_body_at_eof():
    data = encode(msg(1))
    out = read(GOOD + data[:-5])
    assert out[0] == msg(99)
    assert len(out) == 2 and out[1].code == PARSE_ERROR and "body" in out[1].message


@pytest.mark.parametrize("cut", [1, 10, 18, 21])
def test_truncated_headers_at_eof(cut):
    data = encode(msg(1))
    out = read(GOOD + data[:cut])
    assert out[0] == msg(99)
    assert len(out) == 2 and out[1].code == PARSE_ERROR and "headers" in out[1].message


def test_trailing_whitespace_at_eof_is_not_an_error():
    assert read(GOOD + b"\r\n  ") == [msg(99)]


def encode_raw(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


# -- header values of any length ----------------------------------------------------------------


@pytest.mark.parametrize("digits", [19, 20, 4301, 5000, 100_000])
def test_a_content_length_of_thousands_of_digits_is_an_error_not_a_crash(digits):
    """Python's int() refuses strings of more than 4,300 digits; the reader must not let that (or
    any length no frame could have) escape: -32700 for that frame, then the next one read."""
    out = read(b"Content-Length: " + b"9" * digits + b"\r\n\r\n" + GOOD)
    assert isinstance(out[0], FrameError) and out[0].code == PARSE_ERROR, out
    assert out[-1] == msg(99)


@settings(max_examples=200, deadline=None)
@given(value=st.binary(max_size=6000), name=st.sampled_from([b"Content-Length", b"Content-Type", b"X-Other"]))
@example(value=b"1", name=b"Content-Length")
@example(value=b"9" * 5000, name=b"Content-Length")
def test_any_header_value_yields_messages_or_frame_errors_then_resyncs(value, name):
    value = value.replace(b"\r\n", b"")
    out = read(name + b": " + value + b"\r\n\r\n" + GOOD)
    assert all(isinstance(m, (dict, FrameError)) for m in out), out
    if not (name == b"Content-Length" and value.strip().isdigit()):  # a real length may eat the next frame
        assert out and out[-1] == msg(99)
