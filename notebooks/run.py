"""Executes every notebook in this folder top to bottom (outputs are not saved).

    pip install -r notebooks/requirements.txt
    python3 notebooks/run.py
"""
import sys
from pathlib import Path

import nbclient
import nbformat

here = Path(__file__).resolve().parent
failed = 0
for path in sorted(here.glob("*.ipynb")):
    nb = nbformat.read(path, as_version=4)
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(here)}}).execute()
        print(f"ok   {path.name}")
    except Exception as e:  # report every notebook, then fail
        failed += 1
        print(f"FAIL {path.name}: {e}")
sys.exit(1 if failed else 0)
