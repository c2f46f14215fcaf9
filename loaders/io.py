"""Checkpoint I/O: safetensors headers, lazy tensor reads, the sharded writer, side files and destinations.

Every reader and writer of checkpoint directories in the plugin goes through this module: the packed-format
reader and packer (`loaders/packed.py`), the offline tools (`vllm-trn convert-mla`, `vllm-trn quantize`), the
demo checkpoints and the benchmarks. Errors name the file, and the tensor when there is one.

Every writer writes inside ``with StagedCheckpoint(dst) as out:`` (a new sibling directory, renamed to `dst` whole
at the end, removed on any failure) into a `dst` that is absent or an empty directory, and copies only the
`SIDE_FILES` of its source: no tool overwrites a file it did not create, and no reader sees half a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "SHARD_BYTES",
    "SIDE_FILES",
    "Checkpoint",
    "CheckpointFormatError",
    "ShardWriter",
    "StagedCheckpoint",
    "TensorEntry",
    "TensorReader",
    "check_destination",
    "copy_side_files",
    "scan_dir",
    "scan_file",
    "write_config",
]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 1 << 30  # default size of one written shard

# The files besides config.json and the weights that a written checkpoint takes from its source (`copy_side_files`):
# generation defaults, the chat template and the tokenizer in each of its Hugging Face forms (fast tokenizer, its
# config, special and added tokens, BPE vocab + merges, WordPiece vocab, SentencePiece model). Nothing else:
# not weights in another format (pytorch_model.bin, *.pt, *.gguf: a packed checkpoint must not carry its unquantized
# original), not code, not a README or licence (copy those yourself when you redistribute).
SIDE_FILES = (
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "merges.txt",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
)


class CheckpointFormatError(ValueError):
    """A checkpoint tensor that cannot be loaded as declared (the message names file and tensor)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header describes it: its file, dtype string (e.g. "BF16", "U8"), shape and the
    offset of its data in the file's data section."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own cap on a header's length


def scan_file(path: Path) -> dict[str, TensorEntry]:
    """A safetensors file's header, checked against the file size so that truncation names the first cut tensor.

    Entries are ordered by offset, so reading in this order walks the file front to back."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n > MAX_HEADER_BYTES:  # read nothing of a length no writer produces (safetensors refuses it too)
            raise CheckpointFormatError(
                f"{path}: safetensors header length {n} bytes exceeds the format's limit of {MAX_HEADER_BYTES}"
            )
        if n < 2 or 8 + n > size:
            raise CheckpointFormatError(
                f"{path}: not a complete safetensors file (header cut off; file is {size} bytes)"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointFormatError(f"{path}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: corrupt safetensors header")
    data = size - 8 - n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            entry = TensorEntry(path, str(info["dtype"]), tuple(int(d) for d in info["shape"]), begin)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFormatError(f"{path}: tensor {name}: corrupt safetensors header entry ({e})") from e
        if end > data:
            raise CheckpointFormatError(
                f"{path}: tensor {name}: file truncated (tensor needs data bytes {begin}..{end}, file holds {data})"
            )
        entries[name] = entry
    return dict(sorted(entries.items(), key=lambda kv: kv[1].begin))


def scan_dir(root: Path) -> dict[str, TensorEntry]:
    """Every tensor of every ``*.safetensors`` file in ``root`` (files in name order); a name in two files is an
    error naming both."""
    files = sorted(Path(root).glob("*.safetensors"))
    if not files:
        raise CheckpointFormatError(f"{root}: no *.safetensors files")
    entries: dict[str, TensorEntry] = {}
    for path in files:
        for name, entry in scan_file(path).items():
            if name in entries:
                raise CheckpointFormatError(f"{path}: tensor {name}: also in {entries[name].file}")
            entries[name] = entry
    return entries


class TensorReader(ExitStack):
    """Reads tensors one at a time, keeping one open ``safe_open`` handle per file until closed (a context
    manager)."""

    def __init__(self) -> None:
        super().__init__()
        self._handles: dict[Path, Any] = {}

    def get(self, name: str, entry: TensorEntry) -> torch.Tensor:
        try:
            handle = self._handles.get(entry.file)
            if handle is None:
                handle = self._handles[entry.file] = self.enter_context(safe_open(str(entry.file), "pt"))
            return handle.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointFormatError(f"{entry.file}: tensor {name}: cannot read: {e}") from e


class Checkpoint(ExitStack):
    """A checkpoint directory read lazily: config.json and every safetensors header up front, one tensor per `get`.
    A context manager (closes its files)."""

    def __init__(self, root: str | Path) -> None:
        super().__init__()
        self.root = Path(root)
        self.config_path = self.root / CONFIG_FILE
        if not self.config_path.is_file():
            raise FileNotFoundError(f"{self.config_path}: not found (a checkpoint directory needs {CONFIG_FILE})")
        try:
            self.config: dict[str, Any] = json.loads(self.config_path.read_text())
        except ValueError as e:
            raise ValueError(f"{self.config_path}: not valid JSON: {e}") from e
        self.entries = scan_dir(self.root)
        self._reader = self.enter_context(TensorReader())

    def where(self, name: str) -> str:
        """'<file>: tensor <name>', the prefix of every message about that tensor."""
        entry = self.entries.get(name)
        return f"{entry.file if entry else self.root}: tensor {name}"

    def require(self, names: list[str], shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        """Header-only check: every name present (and of the given shape)."""
        for name in names:
            if name not in self.entries:
                raise CheckpointFormatError(f"{self.root}: tensor {name} is missing")
            if shapes and name in shapes and self.entries[name].shape != shapes[name]:
                raise CheckpointFormatError(
                    f"{self.where(name)}: shape {list(self.entries[name].shape)}, expected {list(shapes[name])}"
                )

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Tensor `name` as stored (checked against `shape` when given)."""
        if name not in self.entries:
            raise CheckpointFormatError(f"{self.root}: tensor {name} is missing")
        t = self._reader.get(name, self.entries[name])
        if shape is not None and tuple(t.shape) != shape:
            raise CheckpointFormatError(f"{self.where(name)}: shape {list(t.shape)}, expected {list(shape)}")
        return t

    def f32(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return self.get(name, shape).float()

    def names(self, prefix: str) -> Iterator[str]:
        """The tensor names starting with `prefix`, in file order."""
        return (n for n in self.entries if n.startswith(prefix))


class ShardWriter:
    """Writes tensors into shards of at most about ``max_bytes`` each (one tensor may exceed it), each shard as soon
    as it is full, so that memory holds at most one shard.

    `finish` names the shards as Hugging Face does (``model.safetensors`` alone, else
    ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``) and returns their names. `dst` is the
    directory a `StagedCheckpoint` gives, which removes the unfinished shards of a failed run with it."""

    def __init__(self, dst: Path, max_bytes: int = SHARD_BYTES) -> None:
        self.dst, self.max_bytes = Path(dst), max_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._size = 0
        self._done: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self.total = 0  # bytes added so far

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"{self.dst}: tensor {name} written twice")
        self._names.add(name)
        n = t.numel() * t.element_size()
        if self._pending and self._size + n > self.max_bytes:
            self._flush()
        self._pending[name] = t.contiguous()
        self._size += n
        self.total += n

    def _flush(self) -> None:
        path = self.dst / f".shard-{len(self._done):05d}.safetensors.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._done.append((path, list(self._pending)))
        self._pending, self._size = {}, 0

    def finish(self) -> list[str]:
        if self._pending or not self._done:
            self._flush()
        n = len(self._done)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map: dict[str, str] = {}
        for (tmp, tensors), final in zip(self._done, names):
            tmp.rename(self.dst / final)
            weight_map.update(dict.fromkeys(tensors, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names


def check_destination(dst: str | Path, src: str | Path | None = None) -> Path:
    """`dst` as a Path if a checkpoint may be written there: it is absent or an empty directory, and not `src`.
    Anything else is refused (FileExistsError naming `dst`), so that no tool replaces a file it did not create."""
    dst = Path(dst)
    if src is not None and dst.exists() and dst.resolve() == Path(src).resolve():
        raise ValueError(f"destination {dst} is the source directory")
    if dst.is_dir() and any(dst.iterdir()):
        raise FileExistsError(
            f"{dst}: the destination is not empty; a checkpoint is written only into a new or empty directory "
            "(choose another path, or remove this one first)"
        )
    if (dst.exists() or dst.is_symlink()) and not dst.is_dir():
        raise FileExistsError(f"{dst}: the destination exists and is not a directory")
    return dst


class StagedCheckpoint:
    """A checkpoint written out of sight and put in place whole: ``with StagedCheckpoint(dst, src) as out:`` writes
    into `out` and, when the block ends without an exception, renames `out` to `dst` in one step.

    `dst` must pass `check_destination` (absent or empty; checked here, before anything is written, and again at the
    rename). `out` is a new sibling ``<dst>.partial-<pid>`` (same filesystem, so the rename is atomic); an exception in
    the block (KeyboardInterrupt included) removes it. A reader of `dst` sees nothing (or the empty directory that
    was there) until the whole checkpoint appears. Only a process killed outright leaves ``<dst>.partial-<pid>``
    behind. Without ``with``: `open` returns `out`, then `commit` or `discard`."""

    def __init__(self, dst: str | Path, src: str | Path | None = None) -> None:
        self.dst = check_destination(dst, src)
        self.path: Path | None = None  # the staging directory while open

    def open(self) -> Path:
        """Create and return the staging directory (and `dst`'s missing parents)."""
        if self.path is not None:
            raise RuntimeError(f"{self.dst}: already staged in {self.path}")
        target = Path(os.path.abspath(self.dst))
        target.parent.mkdir(parents=True, exist_ok=True)
        n = 0
        while True:
            path = target.with_name(f"{target.name}.partial-{os.getpid()}" + (f"-{n}" if n else ""))
            try:
                path.mkdir()
                break
            except FileExistsError:  # left by a killed process that had this pid
                n += 1
        self.path = path
        return path

    def commit(self) -> Path:
        """Rename the staging directory to `dst` (still absent or empty, or nothing is renamed); returns `dst`. On
        any failure the staging directory is removed."""
        if self.path is None:
            raise RuntimeError(f"{self.dst}: nothing staged to commit")
        try:
            check_destination(self.dst)
            # rename(2) replaces only an absent name or an empty directory; a file or a non-empty directory that
            # appeared since the check makes it fail.
            self.path.rename(self.dst)
        except BaseException:
            self.discard()
            raise
        self.path = None
        return self.dst

    def discard(self) -> None:
        """Remove the staging directory and everything in it (nothing when already committed or discarded)."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None

    def __enter__(self) -> Path:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the `SIDE_FILES` that `src` has (tokenizer, chat template, generation config) into `dst`; returns their
    names. An existing file in `dst` is never replaced (FileExistsError)."""
    copied = []
    for name in SIDE_FILES:
        p, target = Path(src) / name, Path(dst) / name
        if not p.is_file():
            continue
        with open(p, "rb") as r, open(target, "xb") as w:  # "x": refuse to replace a file
            shutil.copyfileobj(r, w)
        shutil.copystat(p, target)
        copied.append(name)
    return copied


def write_config(dst: Path, config: dict[str, Any]) -> None:
    """config.json of `dst` (sorted keys, two-space indent)."""
    (Path(dst) / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
