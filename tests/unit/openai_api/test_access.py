"""A user sees only batches they created and files under their own key; the batch DAG's permissions come from the auth manager."""

from __future__ import annotations

from airflow_vllm_batch.openai_api.access import owner_key, owns


def test_a_run_without_an_owner_is_nobodys():
    assert not owns({"owner": None}, "")
    assert not owns(None, "alice")


def test_each_user_has_a_key_of_their_own_safe_in_s3():
    keys = {owner_key(u) for u in ("alice", "bob", "Alice", "a/b", "../x")}
    assert len(keys) == 5
    assert all(k.isalnum() and len(k) == 24 for k in keys)
