"""Publish a trained head on the Hugging Face Hub: config.json, model.safetensors and a generated model card.

    python scripts/publish.py head=outputs/eagle/head repo_id=<user>/<name> [private=true] [revision=v1]
    python scripts/publish.py head=outputs/eagle/head repo_id=<user>/<name> dry_run=true out=staged/
    ... serving=outputs/reports/llamacpp.json   # the card also shows the head inside serving engines

The token is HF_TOKEN or the one `hf auth login` cached. dry_run=true writes exactly the folder that would be
uploaded to out= and sends nothing. Rerunning after an interruption is safe: upload_folder is idempotent
(files already on the Hub are not sent again; an unchanged folder makes no new commit). Afterwards
`selfspec generate head=<user>/<name>` (with the head's drafter= and target=, as the card and the last line
printed say) loads the head by id. The model card is publish/card.py's. Prints one JSON line last.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from selfspec.core.cli import entry
from selfspec.core.errors import UserError
from selfspec.heads.checkpoint import CONFIG_NAME
from selfspec.publish.card import generate_args
from selfspec.publish.hub import UPLOADED, check_repo_id, hub_token, stage, upload

PLACEHOLDER = "<"


@dataclass
class PublishConfig:
    head: str = field(default="<set head=FOLDER>", metadata={"help": (
        "The head to publish: a head folder (config.json + model.safetensors) or a single .safetensors/.pt file.")})
    repo_id: str = field(default="<set repo_id=USER/NAME>", metadata={"help": (
        "Hub repo, '<user or org>/<name>'; created if missing (exist_ok).")})
    private: bool = field(default=False, metadata={"help": (
        "Create the repo private (only applies when it is created).")})
    revision: Optional[str] = field(default=None, metadata={"help": (
        "Branch to commit to (created from main if missing); null = main.")})
    commit_message: Optional[str] = field(default=None, metadata={"help": (
        'Commit message; null = "Upload selfspec head (config.json, model.safetensors, README.md)".')})
    dry_run: bool = field(default=False, metadata={"help": (
        "Write the folder that would be uploaded to `out` and upload nothing.")})
    out: Optional[str] = field(default=None, metadata={"help": (
        "dry_run: the folder to write: new, empty, or one this command staged (never the head or a folder holding "
        "other files).")})
    bench: Optional[str] = field(default=None, metadata={"help": (
        "Benchmark to report in the card; null = bench.json beside the head folder if there is one.")})
    serving: Optional[str] = field(default=None, metadata={"help": (
        "scripts/serve_bench.py's output_file: the head inside serving engines, reported in the card; null = none.")})


@entry("publish", PublishConfig)
def main(cfg: PublishConfig) -> dict:
    if cfg.head.startswith(PLACEHOLDER):
        raise UserError("pass head=<head folder> (see `python scripts/publish.py --cfg`)")
    repo_id = check_repo_id(cfg.repo_id)
    if not Path(cfg.head).expanduser().exists():
        raise UserError(f"head '{cfg.head}' not found; pass a head folder or a .safetensors/.pt checkpoint")
    if cfg.dry_run:
        if not cfg.out:
            raise UserError("dry_run=true needs out=<folder> to write the staged repo to")
        folder = stage(cfg.head, cfg.out, repo_id, cfg.bench, cfg.serving)
        files = sorted(p.name for p in folder.iterdir())
        print(f"[publish] dry run: {folder} holds what would be uploaded to {repo_id}: {', '.join(files)}")
        result = {"repo_id": repo_id, "dry_run": True, "out": str(folder), "files": files}
    else:
        if cfg.out:
            raise UserError("out= is only for dry_run=true (a real upload stages in a temporary folder)")
        hub_token()  # fail before staging anything when there is no token
        tmp = Path(tempfile.mkdtemp(prefix="selfspec-publish-"))
        try:
            folder = stage(cfg.head, tmp / "repo", repo_id, cfg.bench, cfg.serving)
            record = json.loads((folder / CONFIG_NAME).read_text())
            print(f"[publish] uploading {', '.join(UPLOADED)} to {repo_id}"
                  + (f" (branch {cfg.revision})" if cfg.revision else "") + " ...", flush=True)
            url = upload(folder, repo_id, private=cfg.private, revision=cfg.revision, commit_message=cfg.commit_message)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        args = " ".join([f"head={repo_id}", *generate_args(record["head"], record["target"])])
        print(f"[publish] done: {url}\n[publish] load it with: selfspec generate {args} "
              f"(or python decode/generate.py {args})")
        result = {"repo_id": repo_id, "dry_run": False, "commit": url, "revision": cfg.revision or "main"}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
