"""A real browser for the UI tests: Debian's headless Chromium driven by Selenium, with screenshots.

Chromium and its driver come from Debian (``chromium``, ``chromium-driver``; the Makefile's
``system-deps`` installs them): Selenium is pointed at both executables, so nothing is
downloaded at run time. Every step's screenshot is written to
``test-artifacts/ui/NN-name.png`` in the repo (gitignored), emptied at the start of a run,
so the pictures of the last run are there to be looked at.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.integration.dagrun import REPO

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = REPO / "test-artifacts" / "ui"
#: Page loads and React renders on two busy cores: generous.
WAIT_S = 60


def missing_browser() -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (it is in the dev extra: pip install -e '.[dev]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            return f"{path} is missing: Chromium could not be installed (make system-deps installs chromium and chromium-driver)"
    return None


class Browser:
    """One headless Chromium window of 1400x1000, and the screenshots of its steps.

    :param artifacts: the directory the screenshots go to (emptied first).
    """

    def __init__(self, artifacts: Path = ARTIFACTS) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        shutil.rmtree(artifacts, ignore_errors=True)
        artifacts.mkdir(parents=True)
        self.artifacts = artifacts
        self.screenshots: list[Path] = []
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        # Root in a container: Chromium's sandbox needs user namespaces it may not have.
        for argument in (
            "--headless=new",
            "--no-sandbox",
            "--disable-dev-shm-usage",
            "--disable-gpu",
            "--window-size=1400,1000",
        ):
            options.add_argument(argument)
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)

    def close(self) -> None:
        self.driver.quit()

    def screenshot(self, name: str, element: Any = None) -> Path:
        """Save the window (or one element) as ``NN-name.png``, numbered in the order taken."""
        path = self.artifacts / f"{len(self.screenshots) + 1:02d}-{name}.png"
        if element is None:
            self.driver.save_screenshot(str(path))
        else:
            element.screenshot(str(path))
        self.screenshots.append(path)
        return path

    def wait(self, condition: Callable[[Any], Any], timeout: float = WAIT_S) -> Any:
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout).until(condition)

    def find(self, xpath: str, clickable: bool = False, timeout: float = WAIT_S) -> Any:
        """The element at ``xpath`` once it is there (and clickable, if asked)."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions as ec

        located = ec.element_to_be_clickable if clickable else ec.presence_of_element_located
        return self.wait(located((By.XPATH, xpath)), timeout)

    def click(self, xpath: str) -> Any:
        element = self.find(xpath, clickable=True)
        self.scroll_to(element)
        element.click()
        return element

    def scroll_to(self, element: Any) -> None:
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)

    def type_into(self, element: Any, text: str) -> None:
        """Replace an input's value the way a person does: select all, type, leave the field."""
        from selenium.webdriver.common.keys import Keys

        self.scroll_to(element)
        element.click()
        element.send_keys(Keys.CONTROL, "a")
        element.send_keys(Keys.BACKSPACE)
        element.send_keys(text)
        element.send_keys(Keys.TAB)

    def double_click_and_type(self, element: Any, text: str) -> None:
        """Select a word by double-clicking it (e.g. in a code editor) and type over it."""
        from selenium.webdriver.common.action_chains import ActionChains

        self.scroll_to(element)
        ActionChains(self.driver).double_click(element).perform()
        self.driver.switch_to.active_element.send_keys(text)

    def settle(self, seconds: float = 1.0) -> None:
        """Let the page finish an animation before a screenshot (the UI fades dialogs in)."""
        time.sleep(seconds)
