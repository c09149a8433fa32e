"""The monitor page in real headless Chromium (Debian's `chromium` + `chromium-driver`, driven by selenium).

A 3-server swarm covers a 6-block model; the page shows it healthy. Killing the server of blocks 2:4 (no replica)
turns the coverage bar's blocks 2 and 3 red and the page says "missing blocks 2:4" within the servers' announce
period, long before its DHT record expires; `corolla status` agrees. A chat message typed into the page streams
back from `corolla api`, which serves the same page: text appears while the response is still open. Screenshots of
each state go to bench/results/.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from api.api_harness import ApiProcess
from conftest import SERVER_ARGS, TestSwarm, run_corolla
from corolla import AutoDistributedModelForCausalLM
from corolla.cli.demo_cmd import demo_model_path
from monitor_helpers import running_monitor, wait_for

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
ANNOUNCE_PERIOD = 15.0  # seconds between the servers' announces; their records live 90 s
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", "--window-size=1200,1000",
]


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        pytest.skip("Chromium is not installed (apt-get install chromium chromium-driver; .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def page_text(driver, selector: str) -> str | None:
    """textContent of the first element matching `selector` (read in the page: the poller replaces its nodes)."""
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", selector)


def block_counts(driver) -> list[int]:
    return driver.execute_script(
        "return [...document.querySelectorAll('[data-testid=coverage-bar] .block')].map(b => Number(b.dataset.count));")


def screenshot(driver, name: str) -> None:
    """The page's content (header and cards, without the empty space below) as bench/results/NAME."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    assert driver.find_element("tag name", "body").screenshot(str(RESULTS / name)), f"no screenshot {name}"


def test_the_page_shows_coverage_live_and_streams_a_chat_reply(browser, tmp_path_factory):
    path = str(demo_model_path())  # six blocks and a tokenizer (corolla api needs one)
    env = {"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}
    log_path = tmp_path_factory.mktemp("logs") / "browser-swarm.log"
    with open(log_path, "w") as log, TestSwarm(log_file=log, env=env) as local:
        peers = local.start_dht()
        procs = {blocks: local.start_server(path, ["--blocks", blocks, *SERVER_ARGS, "--announce-period", str(ANNOUNCE_PERIOD)],
                                            name=f"browser-{blocks}", wait=False) for blocks in ("0:2", "2:4", "4:6")}
        for proc in procs.values():
            local.wait_ready(proc)
        peer_ids = {blocks: proc.peer_id for blocks, proc in procs.items()}

        with running_monitor(peers, "--refresh-period", "1") as monitor:
            browser.get(monitor.url)
            health = lambda: (page_text(browser, "[data-testid=health]"), block_counts(browser))  # noqa: E731
            wait_for(lambda: health() == ("healthy", [1] * 6), 60, describe=health)
            rows = browser.execute_script("return [...document.querySelectorAll('tr[data-peer-id]')].map(r => r.dataset.peerId);")
            assert sorted(rows) == sorted(peer_ids.values())
            assert browser.execute_script("return document.getElementById('chat').hidden") is True  # no API here
            generate_a_little(path, peers)  # some traffic, so the tokens/s chart has something to draw
            time.sleep(2.5)
            screenshot(browser, "monitor_covered.png")

            chat_through_the_api_page(browser, path, peers, env)

            browser.get(monitor.url)
            wait_for(lambda: health() == ("healthy", [1] * 6), 60, describe=health)
            local.kill(procs["2:4"], signal.SIGKILL)  # blocks 2:4 have no replica
            killed = time.monotonic()
            wait_for(lambda: health()[0] == "missing blocks 2:4", 60, 0.1, health)
            seen_after = time.monotonic() - killed
            assert block_counts(browser) == [1, 1, 0, 0, 1, 1]
            state = page_text(browser, f"tr[data-peer-id='{peer_ids['2:4']}'] .pill")
            assert state == "unreachable"
            print(f"page showed 'missing blocks 2:4' {seen_after:.1f}s after the kill (announce period {ANNOUNCE_PERIOD:.0f}s)")
            assert seen_after < ANNOUNCE_PERIOD, f"took {seen_after:.1f}s"
            screenshot(browser, "monitor_missing.png")

        status = run_corolla("status", "--initial-peers", *peers, "--json")
        assert status.returncode == 0, status.stderr
        [model] = json.loads(status.stdout)["models"]
        assert model["missing_ranges"] == ["2:4"]
        assert {s["peer_id"]: s["state"] for s in model["servers"]}[peer_ids["2:4"]] == "unreachable"


def chat_through_the_api_page(browser, path: str, peers: list[str], env: dict[str, str]) -> None:
    """`corolla api` serves the same page with a chat box: a message typed into it streams back from the API's
    /v1/chat/completions, the reply growing on the page while the response is still open."""
    api = ApiProcess(path, peers, [], env)
    try:
        browser.get(api.root + "/")
        wait_for(lambda: page_text(browser, "[data-testid=health]") == "healthy", 60)
        assert browser.execute_script("return document.getElementById('chat').hidden") is False
        browser.find_element("id", "chat-input").send_keys("How is the swarm?")
        browser.find_element("id", "chat-send").click()
        seen: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            busy = browser.execute_script("return document.getElementById('chat-send').disabled")
            text = page_text(browser, "#chat-log .msg.assistant .reply") or ""
            if text and (not seen or seen[-1] != text):
                seen.append(text)
            if not busy and seen:
                break
            time.sleep(0.02)
        chat_log = browser.execute_script("return document.getElementById('chat-log').innerHTML")
        assert page_text(browser, "#chat-log .msg.error") is None, chat_log
        assert seen and seen[-1].strip(), f"no reply: {chat_log}"
        assert len(seen) >= 2 and all(seen[-1].startswith(t) for t in seen), f"the reply did not grow as it streamed: {seen}"
        assert page_text(browser, "#chat-model") == path  # the page asked the API which model it serves
        screenshot(browser, "monitor_chat.png")
    finally:
        api.close()


def generate_a_little(path: str, peers: list[str]) -> None:
    model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=peers, torch_dtype=torch.float32)
    try:
        with model.inference_session(max_length=64) as session:
            model.generate(torch.tensor([[1, 17, 42, 99]]), max_new_tokens=24, session=session)
    finally:
        model.shutdown()
