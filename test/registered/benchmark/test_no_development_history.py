"""The product speaks of itself only: no tracked file under benchmark/, python/ or sgl-kernel/
is named after, or mentions, a development session, call or issue (the word followed by a
number)."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
HISTORY = re.compile(r"\b(session|call|issue)[ _-]?#?\d", re.IGNORECASE)


def test_no_tracked_file_names_a_session_call_or_issue():
    files = subprocess.run(["git", "ls-files", "benchmark", "python", "sgl-kernel"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    assert len(files) > 100
    named = [f for f in files if HISTORY.search(f)]
    assert not named
    mentions = []
    for f in files:
        path = REPO / f
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        mentions += [f"{f}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
                     if HISTORY.search(line)]
    assert not mentions, "\n".join(mentions)
