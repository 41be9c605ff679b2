"""The in-memory store of Responses: newest kept within its byte budget, oldest dropped first."""

from __future__ import annotations

from dgpp.serve.responses_store import ResponseStore


def test_the_oldest_entries_go_first_and_an_oversized_one_is_not_kept() -> None:
    store = ResponseStore(max_bytes=300)
    conversation = [{"type": "message", "role": "user", "content": "x" * 40}]
    for i in range(5):
        assert store.put(f"resp_{i}", {"id": f"resp_{i}"}, conversation)
    assert store.bytes <= 300 and len(store) < 5
    assert store.response("resp_0") is None and store.response("resp_4") == {"id": "resp_4"}
    assert store.conversation("resp_4") == conversation
    assert not store.put("resp_big", {"id": "resp_big"}, [{"content": "y" * 400}])
    assert store.response("resp_big") is None and store.response("resp_4") is not None
    assert store.delete("resp_4") and not store.delete("resp_4") and store.response("resp_4") is None
    assert ResponseStore(max_bytes=0).put("resp_x", {}, []) is False  # 0 stores nothing
