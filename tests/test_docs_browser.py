"""A newcomer's path through the built docs site in a real browser (Debian's headless Chromium, driven by
Selenium): home -> getting started -> the configuration reference, where the site's search for ``lora.rank``
leads to the key -> the SkyRL page. Each page renders (a title and an h1) with no SEVERE entry in the browser's
console; a screenshot of each goes to ``site/screenshots/NN-name.png`` (not committed).

Without chromium and chromedriver (``apt-get install chromium chromium-driver``; ``scripts/setup.sh`` installs
them when it runs as root) the test is skipped, except under ``CI=true``, where it fails."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from pathlib import Path

import pytest
from docs_build import built_site

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def _browser_or_skip() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package (pip install -e '.[docs]')")
    if missing:
        why = f"no browser to drive: {', '.join(missing)} missing (Debian: apt-get install chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def served():
    _browser_or_skip()
    build = built_site()
    assert build.returncode == 0, build.log[-6000:]
    handler = functools.partial(_QuietHandler, directory=str(build.site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield build.site, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--disable-gpu"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # a set path: no Selenium Manager
    drv.set_page_load_timeout(60)
    yield drv
    drv.quit()


def test_newcomer_path(served, driver):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    site, url = served
    shots = site / "screenshots"
    shots.mkdir(exist_ok=True)
    wait = WebDriverWait(driver, 30)
    walked = []

    def check(name: str, h1: str | None = None) -> None:
        """The page rendered (title, h1), logged no SEVERE console entry; screenshot."""
        heading = wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, "article h1")))
        assert driver.title, driver.current_url
        if h1:
            assert h1.lower() in heading.text.lower(), (driver.current_url, heading.text)
        # the site loads nothing from other hosts (mkdocs.yml: no web fonts, no repository widget): any failed
        # request or script error is the site's own
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, (driver.current_url, severe)
        shot(name)

    def shot(name: str) -> None:
        path = shots / f"{len(walked) + 1:02d}-{name}.png"
        driver.save_screenshot(str(path))
        walked.append((name, driver.current_url, path))

    def follow(href_part: str) -> None:
        """Click the navigation's link to a page, as a reader does."""
        link = wait.until(ec.element_to_be_clickable(
            (By.CSS_SELECTOR, f"nav.md-nav--primary a.md-nav__link[href*='{href_part}']")))
        link.click()
        wait.until(lambda d: href_part in d.current_url)

    driver.get(url)
    check("home")
    follow("getting-started/")
    check("getting-started")
    follow("reference/configuration/")
    check("configuration", "configuration")

    # the site's search: lora.rank -> a result that links to the key's own heading
    box = wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input")))
    box.click()
    box.send_keys("lora.rank")
    def key_results(d):
        return [a for a in d.find_elements(By.CSS_SELECTOR, "a.md-search-result__link")
                if (a.get_attribute("href") or "").endswith("#trainer.policy.model.lora.rank")]

    # the results render while the search runs: a link read as it is replaced is stale, and read again
    result = WebDriverWait(driver, 30, ignored_exceptions=(StaleElementReferenceException,)).until(key_results)[0]
    if not result.is_displayed():  # among the page's other matches: "N more on this page", as a reader opens it
        driver.find_element(By.CSS_SELECTOR, "details.md-search-result__more > summary").click()
        wait.until(lambda d: result.is_displayed())
    shot("search-lora-rank")
    result.click()
    wait.until(lambda d: d.current_url.endswith("#trainer.policy.model.lora.rank"))
    key = wait.until(ec.visibility_of_element_located((By.ID, "trainer.policy.model.lora.rank")))
    assert "trainer.policy.model.lora.rank" in key.text
    check("configuration-lora-rank", "configuration")

    follow("skyrl/")
    check("skyrl")
    print("\n".join(f"{name}: {page} -> {path}" for name, page, path in walked))
