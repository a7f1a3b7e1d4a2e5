"""Browser tests: real JupyterLab in real Chromium (a package, so that this folder's conftest.py and
helpers get their own module names instead of shadowing tests/conftest.py)."""
