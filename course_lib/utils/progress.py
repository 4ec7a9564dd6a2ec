"""A progress bar that a saved notebook shows finished.

tqdm's notebook bar is a widget. Beside it, a notebook stores a text picture of the bar, and that
text is what GitHub, VS Code and nbconvert show; tqdm stores the picture taken when the bar was first
displayed, ``0%| 0/N``. The bar here is displayed under a display id and displayed again when it
closes, so the stored text is the finished bar. Outside a notebook it is tqdm's ordinary text bar.
"""

from __future__ import annotations

try:  # a notebook's bar needs IPython; a script under torchrun, or on a GPU machine without Jupyter, does not
    from IPython.display import display
except ImportError:
    display = None
from tqdm.auto import tqdm as _auto_tqdm
from tqdm.notebook import tqdm as _notebook_tqdm

__all__ = ["progress_bar"]


class _StoredNotebookBar(_auto_tqdm):
    def __init__(self, *args, **kwargs):
        kwargs["display"] = False  # shown below, under a display id
        super().__init__(*args, **kwargs)
        self._handle = None
        if not self.disable:
            self._handle = display(self.container, display_id=True)
            self.displayed = True

    def close(self):
        super().close()
        handle, self._handle = self._handle, None
        if handle is None:
            return
        if self.leave or (self.total and self.n < self.total):  # an unfinished bar stays, in red
            handle.update(self.container)
        else:
            handle.update({"text/plain": ""}, raw=True)


def progress_bar(iterable=None, *, total=None, desc=None, leave=True):
    """``tqdm(iterable, total=..., desc=..., leave=...)`` whose saved notebook output is the final bar."""
    cls = _StoredNotebookBar if issubclass(_auto_tqdm, _notebook_tqdm) else _auto_tqdm
    return cls(iterable, total=total, desc=desc, leave=leave)
