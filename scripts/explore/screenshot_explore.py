"""The README's screenshot of `h2o-mini explore`: a page opened in headless Chromium at one layer and step.

    h2o-mini explore --tokens 512 --policy h2o --policy local --budget 64 --out explore.html
    python scripts/explore/screenshot_explore.py explore.html results/explore/explore.png [layer] [step]
"""
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

page, out = Path(sys.argv[1]).resolve(), sys.argv[2]
layer, step = (sys.argv[3] if len(sys.argv) > 3 else "15"), (sys.argv[4] if len(sys.argv) > 4 else "300")
options = webdriver.ChromeOptions()
options.binary_location = "/usr/bin/chromium"
for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-background-networking", "--window-size=1500,1000", "--hide-scrollbars"):
    options.add_argument(flag)
driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
try:
    driver.get(page.as_uri())
    driver.execute_script("const l = document.getElementById('layer'); l.value = arguments[0]; l.dispatchEvent(new Event('change'));"
                          "const s = document.getElementById('step'); s.value = arguments[1]; s.dispatchEvent(new Event('input'));",
                          layer, step)
    driver.save_screenshot(out)
finally:
    driver.quit()
print(out)
