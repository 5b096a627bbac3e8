"""The main server and its clients, shared by test_openai.py and test_limits.py (one process for
the whole session; tests that need other flags spawn their own)."""

import os

import pytest

from test_openai import FRUGAL_BIN, MAIN_ARGS, Server


@pytest.fixture(scope="session")
def server():
    assert os.access(FRUGAL_BIN, os.X_OK), f"no executable at {FRUGAL_BIN} (set FRUGAL_BIN)"
    s = Server(*MAIN_ARGS)
    yield s
    s.stop_and_check()


@pytest.fixture(scope="session")
def client(server):
    c = server.client()
    yield c
    c.close()


@pytest.fixture(scope="session")
def http(server):
    c = server.http()
    yield c
    c.close()


@pytest.fixture(scope="session")
def model_id(http):
    r = http.get("/v1/models")
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["id"]
