"""The search page at `/`, driven in a real browser against a real server.

Starts `vitrieval-serve --read-only` as a subprocess over the digits gallery (see
conftest.py) and drives headless Chromium with selenium: pick an image, see the
top-k neighbours as thumbnails with scores and labels; a file that is not an image
shows an error.

Needs Debian's `chromium` and `chromium-driver` packages (/usr/bin/chromium,
/usr/bin/chromedriver; `.ci/run` installs them). Without them these tests FAIL rather
than skip: the page is a required feature and must be tested.
"""

from __future__ import annotations

import csv
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import Server  # tests/serving.py

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
READY_TIMEOUT_S = 60
WAIT_S = 20

# Without the background-networking flags chromium hangs on a machine with no network.
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
)


@pytest.fixture(scope="module")
def server(
    digits_gallery: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The base URL of a read-only `vitrieval-serve` over a copy of the digits gallery."""
    index = tmp_path_factory.mktemp("web_page") / "index"
    shutil.copytree(digits_gallery["index"], index)
    server = Server(digits_gallery["model"], index, "--read-only")
    try:
        server.wait_ready(READY_TIMEOUT_S)
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Headless Chromium under chromedriver; fails (not skips) when either is missing."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if missing:
        pytest.fail(
            f"{' and '.join(missing)} not found: the web page test needs Debian's chromium "
            "and chromium-driver packages (apt-get install chromium chromium-driver)",
            pytrace=False,
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    root = tmp_path_factory.mktemp("chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={root / 'profile'}")
    service = Service(str(CHROMEDRIVER), log_output=str(root / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def query(digits_gallery: dict[str, Path]) -> dict[str, str]:
    """One gallery image: its path, key and label."""
    with open(digits_gallery["list"], newline="") as fh:
        row = list(csv.DictReader(fh))[17]
    path = digits_gallery["images"] / row["path"]
    assert path.is_file()
    return {"path": str(path), "key": row["key"], "label": row["label"]}


def _wait(driver, condition, message: str):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # The page replaces #results whole when a search answers: an element found just
    # before that is stale by the time the condition reads it, which only means "ask again".
    return WebDriverWait(
        driver, WAIT_S, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
    ).until(condition, message)


def _open_page(driver, url: str) -> None:
    driver.get(url + "/")
    assert "vitrieval" in driver.title
    # the /v1/info fetch fills the heading once the page's script has run
    _wait(driver, lambda d: "images indexed" in d.find_element("id", "about").text, "no info")


def _upload(driver, path: str) -> None:
    # the input is `hidden` (the drop zone is its label): chromedriver still accepts files
    driver.find_element("id", "file").send_keys(path)


def _hits(driver) -> list:
    return driver.find_elements("css selector", "#results li.hit")


def _hit_keys(driver) -> list[str]:
    """The shown hits' keys, read in one script call (no element can go stale between reads)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#results li.hit'), h => h.dataset.key);"
    )


def test_upload_shows_neighbours(browser, server: str, query: dict[str, str], tmp_path: Path):
    _open_page(browser, server)
    k_input = browser.find_element("id", "k")
    k_input.clear()
    k_input.send_keys("7")
    k = int(k_input.get_attribute("value"))
    assert k == 7

    _upload(browser, query["path"])
    _wait(browser, lambda d: len(_hits(d)) > 0, "no results appeared in #results")

    status = browser.find_element("id", "status")
    assert "error" not in (status.get_attribute("class") or "")
    assert status.text.startswith(f"{k} results")
    hits = _hits(browser)
    assert len(hits) == k
    assert hits[0].get_attribute("data-key") == query["key"]
    assert hits[0].find_element("css selector", ".score").text == "1.0000"
    assert hits[0].find_element("css selector", ".label").text == f"· {query['label']}"
    scores = []
    for hit in hits:
        score = hit.find_element("css selector", ".score").text
        assert re.fullmatch(r"-?\d\.\d{4}", score), score
        scores.append(float(score))
        assert re.fullmatch(r"· \d", hit.find_element("css selector", ".label").text)
        assert hit.find_element("css selector", ".key").text.endswith(hit.get_attribute("data-key"))
    assert scores == sorted(scores, reverse=True)

    # the query's preview and at least the first thumbnail decoded in the browser
    # (a thumbnail that fails is replaced by a "no image" box: no img left to wait on)
    loaded = _wait(
        browser,
        lambda d: d.execute_script(
            "const img = arguments[0].querySelector('img');"
            "return img ? img.complete && img.naturalWidth > 0 : 'no image';",
            hits[0],
        ),
        "the first thumbnail did not load",
    )
    assert loaded is True, f"the first thumbnail failed to load ({loaded})"
    preview = browser.find_element("id", "preview")
    assert browser.execute_script("return arguments[0].naturalWidth", preview) > 0

    shot = tmp_path / "page.png"
    assert browser.save_screenshot(str(shot))
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_not_an_image_shows_error(
    browser, server: str, query: dict[str, str], tmp_path: Path
) -> None:
    _open_page(browser, server)
    _upload(browser, query["path"])  # results first: the error must clear them
    _wait(browser, lambda d: len(_hits(d)) > 0, "no results appeared in #results")

    bogus = tmp_path / "notes.png"
    bogus.write_text("this is plain text, not a PNG\n")
    _upload(browser, str(bogus))
    status = browser.find_element("id", "status")
    _wait(browser, lambda d: "error" in (status.get_attribute("class") or ""), "no error shown")
    assert re.match(r"4\d\d: \S", status.text), status.text
    assert _hits(browser) == []


def test_read_only_page_hides_the_key_field_and_searches_more_like_a_hit(
    browser, server: str, query: dict[str, str]
) -> None:
    _open_page(browser, server)
    assert not browser.find_element("id", "keybox").is_displayed()  # nothing to unlock
    _upload(browser, query["path"])
    _wait(browser, lambda d: len(_hit_keys(d)) > 1, "no results appeared in #results")
    clicked_key = _hit_keys(browser)[1]
    assert clicked_key != query["key"]
    hit = f'#results li.hit[data-key="{clicked_key}"]'
    _wait(browser, lambda d: d.find_element("css selector", hit).click() or True, "no click")
    # the item's own vector is the query now, the item itself left out of its hits
    _wait(
        browser,
        lambda d: (keys := _hit_keys(d)) and clicked_key not in keys,
        "clicking a hit did not search for more like it",
    )
    assert f"more like {clicked_key}" in browser.find_element("id", "drop-text").text
    assert "error" not in (browser.find_element("id", "status").get_attribute("class") or "")


def test_api_docs_render_offline(browser, server: str) -> None:
    """/docs loads Swagger UI from the server itself: no external host in the HTML
    (this machine has no network either), and the operations are listed."""
    import httpx

    html = httpx.get(server + "/docs").text
    hosts = set(re.findall(r"(?:src|href)=['\"](https?://[^/'\"]+)", html))
    assert hosts == set(), hosts
    browser.get(server + "/docs")
    _wait(
        browser,
        lambda d: len(d.find_elements("css selector", ".opblock")) >= 8,
        "Swagger UI did not list the operations",
    )
    paths = {e.text for e in browser.find_elements("css selector", ".opblock-summary-path")}
    assert {"/v1/search", "/v1/items", "/v1/evaluate"} <= paths, paths
    shot = Path(server.replace("http://", "").replace(":", "_") + "-docs.png")
    shot = Path("/tmp") / shot.name
    assert browser.save_screenshot(str(shot))
    print(f"screenshot of /docs: {shot}")


REVIEW_KEY = "web-review-key-0123"


@pytest.fixture(scope="module")
def writable_server(digits_gallery: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """A writable `vitrieval-serve` over a copy of the digits gallery with two planted
    copies: the same image files under new keys (identical vectors)."""
    import httpx

    index = tmp_path_factory.mktemp("web_review") / "index"
    shutil.copytree(digits_gallery["index"], index)
    server = Server(digits_gallery["model"], index, env={"VITRIEVAL_API_KEY": REVIEW_KEY})
    try:
        server.wait_ready(READY_TIMEOUT_S)
        with open(digits_gallery["list"], newline="") as fh:
            rows = list(csv.DictReader(fh))
        for row in (rows[3], rows[40]):
            with open(digits_gallery["images"] / row["path"], "rb") as image:
                answer = httpx.post(
                    server.url + "/v1/items",
                    data={"key": f"copy/{row['key']}"},
                    files={"image": image},
                    headers={"X-API-Key": REVIEW_KEY},
                )
            assert answer.status_code == 201, answer.text
        yield server.url, [f"copy/{rows[3]['key']}", f"copy/{rows[40]['key']}"]
    finally:
        server.stop()


def test_review_duplicates_open_a_group_delete_one_and_the_group_updates(
    browser, writable_server
) -> None:
    url, copies = writable_server
    _open_page(browser, url)
    browser.find_element("id", "threshold").send_keys("0.99999")
    browser.find_element("id", "find-duplicates").click()
    _wait(
        browser,
        lambda d: "groups at threshold" in d.find_element("id", "review-status").text,
        "the duplicates job did not finish",
    )
    groups = browser.execute_script(
        "return Array.from(document.querySelectorAll('#groups li.group'), g => g.textContent);"
    )
    assert len(groups) >= 2, groups
    # open each group until the one holding the first planted copy shows
    for n in range(len(groups)):  # a click redraws the list: find the n-th afresh
        browser.find_elements("css selector", "#groups li.group")[n].click()
        if browser.find_elements("css selector", f'#group-view li[data-key="{copies[0]}"]'):
            break
    assert len(browser.find_elements("css selector", "#groups li.group.open")) == 1
    members = browser.execute_script(
        "return Array.from(document.querySelectorAll('#group-view li'), m => m.dataset.key);"
    )
    assert copies[0] in members and len(members) >= 2
    assert browser.find_elements("css selector", "#group-view .keep")  # the suggestion
    # no key yet: the delete is refused and the key field appears
    button = f'#group-view li[data-key="{copies[0]}"] button.delete'
    browser.find_element("css selector", button).click()
    _wait(browser, lambda d: d.find_element("id", "keybox").is_displayed(), "no key field")
    browser.find_element("id", "apikey").send_keys(REVIEW_KEY)
    browser.find_element("css selector", button).click()
    _wait(
        browser,
        lambda d: f"deleted {copies[0]}" in d.find_element("id", "review-status").text,
        "the delete did not answer",
    )
    left = browser.execute_script(
        "return Array.from(document.querySelectorAll('#group-view li'), m => m.dataset.key);"
    )
    assert copies[0] not in left
    if len(members) == 2:  # a pair: resolved, gone from the list
        assert len(browser.find_elements("css selector", "#groups li.group")) == len(groups) - 1
    else:
        assert len(left) == len(members) - 1
    import httpx

    assert httpx.get(f"{url}/v1/items/{copies[0]}").status_code == 404
    # the other planted pair: keep the original, which deletes the copy
    for n in range(len(browser.find_elements("css selector", "#groups li.group"))):
        browser.find_elements("css selector", "#groups li.group")[n].click()
        if browser.find_elements("css selector", f'#group-view li[data-key="{copies[1]}"]'):
            break
    original = copies[1].removeprefix("copy/")
    keep = f'#group-view li[data-key="{original}"] button.keep-only'
    browser.find_element("css selector", keep).click()
    _wait(
        browser,
        lambda d: f"deleted {copies[1]}" in d.find_element("id", "review-status").text,
        "keep did not delete the other member",
    )
    assert httpx.get(f"{url}/v1/items/{copies[1]}").status_code == 404
    assert httpx.get(f"{url}/v1/items/{original}").status_code == 200


def test_the_collection_picker_searches_the_collection_picked(
    browser, digits_gallery: dict[str, Path], query: dict[str, str], tmp_path: Path
) -> None:
    """On a data folder server the page lists the collections; a search goes to the one
    picked: the digits gallery (moved in as a collection) finds its own image, an empty
    collection of the same model finds nothing."""
    from selenium.webdriver.support.ui import Select

    from vitrieval.index.collections import COLLECTIONS_DIR, MODELS_DIR, DataFolder

    (tmp_path / "data").mkdir()
    folder = DataFolder(tmp_path / "data")
    shutil.copytree(digits_gallery["index"], folder.root / COLLECTIONS_DIR / "digits")
    shutil.copy(digits_gallery["model"], folder.root / MODELS_DIR / "tiny.onnx")
    folder.create("empty", "tiny.onnx")
    server = Server(None, None, "--read-only", data=folder.root)
    try:
        server.wait_ready(READY_TIMEOUT_S)
        browser.get(server.url + "/")
        _wait(browser, lambda d: d.find_element("id", "collectionbox").is_displayed(), "no picker")
        picker = Select(browser.find_element("id", "collection"))
        assert [o.get_attribute("value") for o in picker.options] == ["", "digits", "empty"]
        picker.select_by_value("digits")
        _wait(browser, lambda d: "120 images indexed" in d.find_element("id", "about").text, "info")
        _upload(browser, query["path"])
        _wait(browser, lambda d: len(_hits(d)) > 0, "no results from the digits collection")
        assert _hit_keys(browser)[0] == query["key"]
        picker.select_by_value("empty")
        _wait(browser, lambda d: "0 images indexed" in d.find_element("id", "about").text, "info")
        _wait(browser, lambda d: d.find_element("id", "status").text.startswith("0 results"), "")
        assert _hits(browser) == []
    finally:
        server.stop()
