"""The page at `/` in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`) driven through Selenium, against the spawned server.

- It renders: a screenshot (decoded here, no imaging library) is neither blank nor one colour,
  and the metrics panel shows the server's numbers.
- A chat round trip: a message typed and sent, the reply streamed into the page, the metrics
  panel's token count up by at least the reply's tokens; a second message carries the first
  exchange (the prompt grows); the stop button ends a long reply and the server counts it
  cancelled.
- With `--api-key`, the page still loads, asks for the key, and works once given it.

Skips when Chromium, chromedriver or Selenium is missing, unless FRUGAL_REQUIRE_BROWSER=1
(CI sets it, after installing them): then that is a failure. The screenshot is kept in the log
folder (page.png).

Environment: FRUGAL_CHROMIUM (default /usr/bin/chromium), FRUGAL_CHROMEDRIVER (default
/usr/bin/chromedriver).
"""

import json
import os
import re
import shutil
import struct
import tempfile
import time
import zlib

import pytest

from test_openai import LOG_DIR, Server, _wait_for, get_metrics, metric

CHROMIUM = os.environ.get("FRUGAL_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = os.environ.get("FRUGAL_CHROMEDRIVER") or shutil.which("chromedriver") or "/usr/bin/chromedriver"
WIDTH, HEIGHT = 1100, 760


def _missing():
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"no executable {path} (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (tests/serve/run.sh installs it)"
    return None


@pytest.fixture(scope="module")
def browser():
    why = _missing()
    if why:
        if os.environ.get("FRUGAL_REQUIRE_BROWSER") == "1":
            pytest.fail(f"FRUGAL_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="frugal-page-chromium-")
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in containers
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={WIDTH},{HEIGHT}",
        f"--user-data-dir={profile}",
        "--force-device-scale-factor=1",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=CHROMEDRIVER, log_output=os.path.join(LOG_DIR, "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Helpers


def decode_png(data):
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced RGB or RGBA PNG, which
    is what Chromium's screenshots are; anything else fails the assertion."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    assert ihdr, "no IHDR"
    w, h, depth, ctype, _, _, interlace = ihdr
    assert depth == 8 and ctype in (2, 6) and interlace == 0, f"unexpected PNG format {ihdr}"
    bpp = 3 if ctype == 2 else 4
    stride = w * bpp
    raw = zlib.decompress(b"".join(idat))
    assert len(raw) == h * (stride + 1), "truncated image data"
    rows, prev = [], bytearray(stride)
    for y in range(h):
        base = y * (stride + 1)
        f, line = raw[base], bytearray(raw[base + 1 : base + 1 + stride])
        if f == 1:
            for x in range(bpp, stride):
                line[x] = (line[x] + line[x - bpp]) & 255
        elif f == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, prev))
        elif f == 3:
            for x in range(stride):
                left = line[x - bpp] if x >= bpp else 0
                line[x] = (line[x] + ((left + prev[x]) >> 1)) & 255
        elif f == 4:
            for x in range(stride):
                a = line[x - bpp] if x >= bpp else 0
                b, c = prev[x], prev[x - bpp] if x >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[x] = (line[x] + pred) & 255
        else:
            assert f == 0, f"bad filter {f} in row {y}"
        rows.append(bytes(line))
        prev = line
    return w, h, bpp, rows


def colour_counts(w, bpp, rows):
    counts = {}
    for row in rows:
        for x in range(0, w * bpp, bpp):
            px = row[x : x + 3]
            counts[px] = counts.get(px, 0) + 1
    return counts


def text(driver, id_):
    return driver.find_element("id", id_).text.strip()


def number(driver, id_):
    """A metrics cell as a number (thousands separators removed); None while it shows none."""
    t = text(driver, id_).replace(",", "").replace("%", "").strip()
    try:
        return float(t)
    except ValueError:
        return None


def wait(driver, pred, timeout, what):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except Exception as e:  # the page may be mid-update
            last = repr(e)
        time.sleep(0.1)
    shot = os.path.join(LOG_DIR, f"page-timeout-{int(time.time())}.png")
    driver.save_screenshot(shot)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r}; screenshot {shot})")


def set_field(driver, id_, value):
    el = driver.find_element("id", id_)
    driver.execute_script("arguments[0].value = arguments[1];", el, str(value))


def open_settings(driver):
    driver.execute_script("document.getElementById('settings').open = true;")


def assistant_replies(driver):
    return driver.find_elements("css selector", "#messages li.assistant")


def idle(driver):
    return driver.find_element("id", "chat-form").get_attribute("data-state") == "idle"


def send_message(driver, message, submit_with_enter=False):
    from selenium.webdriver.common.keys import Keys

    before = len(assistant_replies(driver))
    box = driver.find_element("id", "prompt")
    box.clear()
    box.send_keys(message)
    if submit_with_enter:
        box.send_keys(Keys.ENTER)
    else:
        driver.find_element("id", "send").click()
    wait(driver, lambda: len(assistant_replies(driver)) == before + 1, 10, "the reply's bubble")
    return assistant_replies(driver)[-1]


def reply_text(li):
    """The streamed text of a reply, without the note the page adds under it."""
    return li.find_element("css selector", ".text").get_attribute("textContent")


def finished_reply(driver, li, timeout=120):
    wait(driver, lambda: li.get_attribute("data-state") in ("done", "stopped", "error") and idle(driver), timeout, "the reply to finish")
    assert li.get_attribute("data-state") == "done", f"reply ended {li.get_attribute('data-state')}: {li.text}"
    return li


def severe_console_errors(driver):
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


# ---------------------------------------------------------------------------------------------
# Tests


def test_page_renders_with_live_metrics(browser, server, model_id):
    browser.get(server.url + "/")
    assert browser.title == "frugal serve"
    wait(browser, lambda: text(browser, "model-name") == model_id, 15, f"the model name {model_id!r}")
    # Two polls of /metrics: every number filled, tokens/s from the difference between them.
    wait(browser, lambda: number(browser, "m-tps") is not None, 15, "tokens/s")
    for id_ in ("m-running", "m-queued", "m-kv-used", "m-kv-total", "m-gen-tokens", "m-tps", "m-finished"):
        assert number(browser, id_) is not None, f"#{id_} shows {text(browser, id_)!r}"
    samples = get_metrics(server.http())
    total = metric(samples, "frugal_kv_blocks_used") + metric(samples, "frugal_kv_blocks_free")
    assert number(browser, "m-kv-total") == total > 0
    assert number(browser, "m-queued") == 0
    # A percentage once prompts have been looked up in the prefix cache (earlier tests sent
    # some), a dash before.
    rate = number(browser, "m-prefix-rate")
    if metric(samples, "frugal_prefix_cache_queries_total") > 0:
        assert rate is not None and 0 <= rate <= 100, text(browser, "m-prefix-rate")
    else:
        assert text(browser, "m-prefix-rate") == "–"

    png = browser.get_screenshot_as_png()
    with open(os.path.join(LOG_DIR, "page.png"), "wb") as f:
        f.write(png)
    assert len(png) > 5000, f"a {len(png)}-byte screenshot"
    w, h, bpp, rows = decode_png(png)
    assert (w, h) == tuple(browser.execute_script("return [window.innerWidth, window.innerHeight]")), (w, h)
    counts = colour_counts(w, bpp, rows)
    top = max(counts.values())
    # Backgrounds, borders, buttons and anti-aliased text: many colours, none nearly everywhere.
    assert len(counts) >= 16, f"only {len(counts)} colours"
    assert top / (w * h) < 0.95, f"one colour covers {top / (w * h):.1%} of the page"
    assert not severe_console_errors(browser), severe_console_errors(browser)


def test_page_chat_round_trip_and_stop(browser, server, http, model_id):
    browser.get(server.url + "/")
    wait(browser, lambda: text(browser, "model-name") == model_id, 15, "the model name")
    wait(browser, lambda: number(browser, "m-gen-tokens") is not None, 15, "the token count")
    open_settings(browser)
    set_field(browser, "max-tokens", 24)
    set_field(browser, "temperature", 0)
    gen0 = number(browser, "m-gen-tokens")

    first = finished_reply(browser, send_message(browser, "Name three colours.", submit_with_enter=True))
    reply = reply_text(first)
    n1 = int(first.get_attribute("data-completion-tokens"))
    p1 = int(first.get_attribute("data-prompt-tokens"))
    assert reply.strip() and 0 < n1 <= 24, (reply, n1)
    # The panel counts the reply's tokens (at least: nothing else runs, but a poll may lag).
    wait(browser, lambda: number(browser, "m-gen-tokens") >= gen0 + n1, 10, f"the token count to reach {gen0 + n1}")

    second = finished_reply(browser, send_message(browser, "Now three more."))
    p2 = int(second.get_attribute("data-prompt-tokens"))
    # The second request carried the first exchange: its prompt holds the first prompt and reply.
    assert p2 > p1 + n1, (p1, n1, p2)
    users = browser.find_elements("css selector", "#messages li.user")
    assert [u.text for u in users] == ["Name three colours.", "Now three more."]

    # Stop: a reply that would run for 1500 tokens is cut once it has started.
    set_field(browser, "max-tokens", 1500)
    set_field(browser, "extra", json.dumps({"ignore_eos": True}))
    cancelled0 = metric(get_metrics(http), "frugal_requests_total", outcome="cancelled")
    stop = browser.find_element("id", "stop")
    assert not stop.is_enabled(), "stop is enabled with nothing to stop"
    li = send_message(browser, "Tell me a long story.")
    wait(browser, lambda: len(reply_text(li).strip()) > 0, 60, "the long reply to start")
    assert stop.is_enabled()
    stop.click()
    wait(browser, lambda: idle(browser), 10, "the page to stop streaming")
    assert li.get_attribute("data-state") == "stopped"
    assert "stopped" in li.text
    def cancelled():
        n = metric(get_metrics(http), "frugal_requests_total", outcome="cancelled")
        return n > cancelled0, n

    _wait_for(cancelled, 10, "the server to count the stopped reply as cancelled")

    def running():
        n = metric(get_metrics(http), "frugal_requests_running")
        return n == 0, n

    _wait_for(running, 10, "no request running")
    assert not severe_console_errors(browser), severe_console_errors(browser)

    # "New chat" empties the conversation.
    browser.find_element("id", "clear").click()
    assert browser.find_elements("css selector", "#messages li") == []


def test_page_with_api_key(browser):
    key = "sk-page-test"
    s = Server("--ctx", "512", "--kv-budget", "16MiB", "--api-key", key, api_key=key)
    try:
        browser.get(s.url + "/")
        wait(browser, lambda: "API key" in text(browser, "status"), 15, "the page to ask for the key")
        assert browser.find_element("id", "settings").get_attribute("open") is not None
        assert browser.switch_to.active_element.get_attribute("id") == "api-key"
        # /metrics is open: the panel works without the key.
        wait(browser, lambda: (number(browser, "m-kv-total") or 0) > 0, 15, "the metrics panel")
        with s.http() as h:
            model_id = h.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["id"]
        browser.find_element("id", "api-key").send_keys(key)
        browser.find_element("id", "save-key").click()
        wait(browser, lambda: text(browser, "model-name") == model_id, 15, "the model name once the key is given")
        set_field(browser, "max-tokens", 4)
        li = finished_reply(browser, send_message(browser, "Hi"))
        assert int(li.get_attribute("data-completion-tokens")) > 0
    finally:
        s.stop_and_check()
