"""`qerl audit`: query every rollout a run produced, with DuckDB over its Parquet files.

A workspace (`qerl_lib.paths`) holds, per RL step i, `rollouts/step=i/rollouts.parquet` (the
samples as drawn), `rewards/step=i/scored.parquet` (the same rows with rewards, advantages and
kept flags), `metrics/step=i/update.json` (train metrics of update i) and, per evaluated
adapter k, `eval/step=k/samples.parquet`. Beside each rollout / eval file, `provenance.json`
holds the run-dependent facts (seconds, host, flow run id) kept out of the bytes. The files'
schema metadata (`qerl.*` keys) name the base model, quantization, checkpoint hash, library
versions, git commit and config hash (`qerl_lib.schema`).

Views (`Audit.sql`, `qerl audit sql "..."`):

- `rollouts`  every row of rollouts/step=*/rollouts.parquet, plus `file` and `row` (row number)
- `scored`    every row of rewards/step=*/scored.parquet, plus `file` and `row`
- `samples`   one row per training sample: the scored row where reward@i ran, else the rollout row
- `evals`     every row of eval/step=*/samples.parquet, plus `file` and `row`
- `updates`   one row per update.json (scalar fields; `step` is the update's step)

Queries: `summary` (per step), `groups` (GRPO groups, `zero_variance=True` for those whose rewards
are all equal), `prompt` (all samples of one prompt across steps), `lineage` (where one row came
from). Each returns a `Result` that renders as a table, CSV, Markdown or JSON.

The files are plain Parquet: `duckdb.sql("select ... from read_parquet('rewards/*/scored.parquet',
hive_partitioning=false)")` or `polars.read_parquet('rewards/*/scored.parquet',
hive_partitioning=False)` read them without qerl (README, "Audit").
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from qerl_lib.paths import Layout
from qerl_lib.tables import Result

__all__ = ["Audit", "AuditError", "Result", "default_root"]


class AuditError(ValueError):
    """A query that cannot be answered (no files, no such row); the message says why."""


def has_rollouts(root: str | Path) -> bool:
    """Whether `root` holds a rollout or scored file of any step (a workspace `qerl audit` can read)."""
    lay = Layout(root)
    return any(lay.root.glob(f"rollouts/step=*/{lay.rollouts(0).name}")) or any(
        lay.root.glob(f"rewards/step=*/{lay.scored(0).name}"))


def default_root() -> str:
    """The workspace `qerl audit` reads when none is given: the current directory if it holds
    rollouts (a `dvc repro` at the repository root, or a run.root), else the default run.root
    (`runs/default`, where `qerl run` writes) if that does. When neither does: the current
    directory if it is a DVC workspace (params.yaml + dvc.yaml), else the default run.root; the
    error then names the folder that was read and suggests --root."""
    from qerl_lib.config import RunConfig

    candidates = [".", RunConfig().root]
    found = next((c for c in candidates if has_rollouts(c)), None)
    if found is not None:
        return found
    return "." if Path("params.yaml").is_file() and Path("dvc.yaml").is_file() else candidates[1]


# --------------------------------------------------------------------------- the audit


def _files(pattern_dir: Path, name: str) -> list[tuple[int, Path]]:
    """(step, path) of `<dir>/step=<i>/<name>`, by step."""
    out = []
    if pattern_dir.is_dir():
        for d in pattern_dir.glob("step=*"):
            try:
                step = int(d.name.split("=", 1)[1])
            except ValueError:
                continue
            if (d / name).is_file():
                out.append((step, d / name))
    return sorted(out)


def _sql_list(paths: list[Path]) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = obj
    return out


class Audit:
    """DuckDB views over one workspace's rollout datasets (see the module doc)."""

    def __init__(self, root: str | Path):
        import duckdb

        self.layout = Layout(root)
        self.root = self.layout.root
        self.where = str(self.root.resolve())
        """The workspace as an absolute path (named at the top of every result)."""
        if not self.root.is_dir():
            raise AuditError(f"workspace not found: {self.where} (pass the run's folder with --root)")
        self.con = duckdb.connect()
        self.rollout_files = _files(self.layout.rollouts_root, self.layout.rollouts(0).name)
        self.scored_files = _files(self.layout.rewards_root, self.layout.scored(0).name)
        self.eval_files = _files(self.layout.eval_root, self.layout.eval_samples(0).name)
        self._views()

    # ----------------------------------------------------------------- views

    def _parquet_view(self, name: str, files: list[tuple[int, Path]]) -> None:
        if files:
            self.con.execute(
                f"create or replace view {name} as select * exclude (filename, file_row_number), "
                f"filename as file, file_row_number as row from read_parquet({_sql_list([p for _, p in files])}, "
                "hive_partitioning = false, union_by_name = true, filename = true, file_row_number = true)"
            )
        else:
            from qerl_lib.schema import ROLLOUT_SCHEMA

            cols = ", ".join(f'null::{_duck_type(f.type)} as "{f.name}"' for f in ROLLOUT_SCHEMA)
            self.con.execute(f"create or replace view {name} as select {cols}, null::varchar as file, "
                             "null::bigint as row where false")

    def _views(self) -> None:
        self._parquet_view("rollouts", self.rollout_files)
        self._parquet_view("scored", self.scored_files)
        self._parquet_view("evals", self.eval_files)
        scored_steps = {s for s, _ in self.scored_files}
        self.con.execute(
            "create or replace view samples as select * from scored union all by name "
            "select * from rollouts where step not in (select distinct step from scored)"
            if scored_steps else "create or replace view samples as select * from rollouts"
        )
        import pyarrow as pa

        rows = []
        for step, path in _files(self.layout.metrics_root, self.layout.update_metrics(0).name):
            try:
                obj = json.loads(path.read_text())  # NaN (a skipped update's entropy) is valid here
            except (OSError, json.JSONDecodeError):
                continue
            row = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None)
                   for k, v in obj.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            row = {k: (None if v is not None and not math.isfinite(v) else v) for k, v in row.items()}
            row["step"] = step
            rows.append(row)
        keys = sorted({k for r in rows for k in r} | {"step", "entropy", "kl", "sigma", "loss", "seconds"})
        table = pa.table({k: pa.array([r.get(k) for r in rows], type=pa.int64() if k == "step" else pa.float64())
                          for k in keys})
        self._updates = table
        self.con.register("updates_arrow", table)
        self.con.execute("create or replace view updates as select * from updates_arrow")

    def _run(self, query: str, params: list | None = None, title: str = "") -> Result:
        rel = self.con.execute(query, params or [])
        cols = [d[0] for d in rel.description]
        return Result(cols, [tuple(r) for r in rel.fetchall()], title, workspace=self.where)

    def _need_rows(self) -> None:
        if not self.rollout_files and not self.scored_files:
            from qerl_lib.config import RunConfig

            raise AuditError(f"no rollout files in workspace {self.where} (no rollouts/step=*/ there: has a rollout "
                             f"stage run in it?); pass the run's folder with --root (`qerl run` writes to "
                             f"{RunConfig().root} unless run.root says otherwise)")

    # ----------------------------------------------------------------- queries

    def sql(self, query: str) -> Result:
        """Any SQL over the views (rollouts, scored, samples, evals, updates)."""
        import duckdb

        try:
            return self._run(query, title="sql")
        except duckdb.Error as e:
            raise AuditError(f"sql: {e}") from None

    def summary(self) -> Result:
        """Per step: samples, groups, reward mean / std, correct and format rates, completion length
        mean / max, truncation rate, kept fraction (dynamic sampling, overlong filtering), AQN sigma,
        and the update's mean token entropy, KL and loss."""
        self._need_rows()
        return self._run(
            """
            with s as (
                select step, count(*) as n, count(distinct group_id) as groups,
                       avg(reward) as reward_mean, stddev_pop(reward) as reward_std,
                       avg(case when reward_correct > 0 then 1.0 when reward_correct is null then null else 0.0 end)
                           as correct_rate,
                       avg(case when reward_format > 0 then 1.0 when reward_format is null then null else 0.0 end)
                           as format_rate,
                       avg(len(completion_token_ids)) as len_mean, max(len(completion_token_ids)) as len_max,
                       avg(truncated::int) as truncated_rate, avg(kept::int) as kept_frac,
                       max(aqn_sigma) as aqn_sigma, max(policy_version) as policy_version
                from samples group by step
            )
            select s.step, s.n, s.groups, s.reward_mean, s.reward_std, s.correct_rate, s.format_rate,
                   s.len_mean, s.len_max, s.truncated_rate, s.kept_frac, s.aqn_sigma,
                   u.entropy as entropy_mean, u.kl, u.loss, s.policy_version
            from s left join updates u on u.step = s.step
            order by s.step
            """,
            title="per-step summary",
        )

    def groups(self, zero_variance: bool = False, step: int | None = None) -> Result:
        """GRPO groups (one prompt at one step): size, reward mean / std / min / max, correct
        samples, kept. `zero_variance`: only the groups whose rewards are all equal (no advantage:
        dynamic sampling drops them)."""
        self._need_rows()
        where = ["reward is not null"]
        params: list = []
        if step is not None:
            where.append("step = ?")
            params.append(step)
        having = "having min(reward) = max(reward)" if zero_variance else ""
        return self._run(
            f"""
            select step, group_id, prompt_id, count(*) as n, avg(reward) as reward_mean,
                   stddev_pop(reward) as reward_std, min(reward) as reward_min, max(reward) as reward_max,
                   sum((reward_correct > 0)::int) as correct, bool_and(kept) as kept,
                   any_value(ground_truth) as ground_truth, any_value(prompt) as prompt
            from scored where {' and '.join(where)}
            group by step, group_id, prompt_id {having}
            order by step, prompt_id
            """,
            params,
            title="zero-variance groups" if zero_variance else "groups",
        )

    def prompt(self, prompt_id: str) -> Result:
        """Every sample of one prompt: each training step that drew it (scored where available),
        and each evaluation of it."""
        self._need_rows()
        res = self._run(
            """
            select * from (
                select 'train' as kind, step, sample_idx, policy_version, aqn_sigma, temperature, reward,
                       reward_correct, reward_format, advantage, kept, extracted_answer, ground_truth,
                       finish_reason, len(completion_token_ids) as tokens, completion_text, row
                from samples where prompt_id = ?
                union all by name
                select 'eval' as kind, step, sample_idx, policy_version, aqn_sigma, temperature, reward,
                       reward_correct, reward_format, advantage, kept, extracted_answer, ground_truth,
                       finish_reason, len(completion_token_ids) as tokens, completion_text, row
                from evals where prompt_id = ?
            ) order by kind desc, step, temperature desc, sample_idx
            """,
            [prompt_id, prompt_id],
            title=f"samples of prompt {prompt_id}",
        )
        if not res.rows:
            raise AuditError(f"prompt {prompt_id!r} appears in no rollout or eval file under {self.root}")
        return res

    # ----------------------------------------------------------------- lineage

    def _locate(self, step: int | None, row: int | None, prompt_id: str | None,
                sample_idx: int | None) -> tuple[int, int]:
        if row is not None:
            if step is None:
                raise AuditError("lineage --row needs --step")
            return step, row
        if prompt_id is None:
            raise AuditError("lineage needs --step and --row, or --prompt-id (with --sample-idx)")
        q = "select step, row, sample_idx from rollouts where prompt_id = ?"
        params: list = [prompt_id]
        if sample_idx is not None:
            q += " and sample_idx = ?"
            params.append(sample_idx)
        if step is not None:
            q += " and step = ?"
            params.append(step)
        hits = self.con.execute(q + " order by step, sample_idx", params).fetchall()
        if not hits:
            raise AuditError(f"no rollout row with prompt_id={prompt_id!r}"
                             + (f", sample_idx={sample_idx}" if sample_idx is not None else "")
                             + (f" at step {step}" if step is not None else ""))
        if len(hits) > 1:
            where = ", ".join(f"step {s} sample {i}" for s, _, i in hits[:10])
            raise AuditError(f"{len(hits)} rows match ({where}); add --step and/or --sample-idx")
        return int(hits[0][0]), int(hits[0][1])

    def lineage(self, step: int | None = None, row: int | None = None, prompt_id: str | None = None,
                sample_idx: int | None = None) -> Result:
        """Where one training row came from, as (field, value) pairs: the row's own ids and seeds;
        the file's checkpoint, base model, quantization, library versions, git commit and config
        hash; whether the checkpoint and adapter on disk still hash to what the row records; the
        adapter's version and optimizer steps; the flow run and timing (provenance.json); the params
        the rollout stage ran with (dvc.lock, else the workspace config) and whether the config's
        hash matches the file's; the DVC lock entry of the file."""
        import pyarrow.parquet as pq

        from qerl_lib.schema import read_metadata, read_provenance

        self._need_rows()
        step, row = self._locate(step, row, prompt_id, sample_idx)
        path = self.layout.rollouts(step)
        if not path.is_file():
            raise AuditError(f"no rollout file for step {step}: {path}")
        table = pq.read_table(path)
        if not 0 <= row < table.num_rows:
            raise AuditError(f"{path} has {table.num_rows} rows; row {row} does not exist")
        rec = table.slice(row, 1).to_pylist()[0]
        out: list[tuple[str, Any]] = []

        def add(k: str, v: Any) -> None:
            out.append((k, v))

        add("file", str(path))
        add("file.md5", _md5(path))
        add("row", row)
        for k in ("step", "prompt_id", "group_id", "sample_idx", "seed", "policy_version", "adapter_hash",
                  "aqn_sigma", "aqn_seed", "temperature", "top_p", "max_new_tokens", "finish_reason"):
            add(f"row.{k}", rec[k])
        scored = self.layout.scored(step)
        if scored.is_file():
            srec = pq.read_table(scored).slice(row, 1).to_pylist()
            if srec and srec[0]["prompt_id"] == rec["prompt_id"] and srec[0]["sample_idx"] == rec["sample_idx"]:
                for k in ("reward", "reward_correct", "reward_format", "reward_overlong", "advantage", "kept",
                          "extracted_answer"):
                    add(f"scored.{k}", srec[0][k])
        meta = read_metadata(path)
        for k in sorted(meta):
            add(f"meta.{k}", meta[k])

        # checkpoint
        report = self.root / "models"
        ckpt_hash = meta.get("checkpoint_hash", "")
        reports = sorted(report.glob("*/convert_report.json")) if report.is_dir() else []
        on_disk = {}
        for r in reports:
            try:
                on_disk[r.parent.name] = json.loads(r.read_text()).get("checkpoint_hash", "")
            except (OSError, json.JSONDecodeError):
                pass
        match = [name for name, h in on_disk.items() if h == ckpt_hash and h]
        add("checkpoint.dir", str(self.root / "models" / match[0]) if match else "")
        add("checkpoint.matches_workspace", bool(match))

        # adapter
        version = rec["policy_version"]
        adir = self.layout.adapter(version)
        add("adapter.version", version)
        add("adapter.dir", str(adir))
        weights = adir / "adapter_model.safetensors"
        add("adapter.sha256_matches_row", _sha256(weights) == rec["adapter_hash"] if weights.is_file() else None)
        state = adir / "trainer_state.json"
        if state.is_file():
            for k, v in json.loads(state.read_text()).items():
                add(f"adapter.trainer_state.{k}", v)
        add("adapter.made_by", "init_adapter" if version == 0 else f"update@{version - 1}")
        if version > 0:
            upd = self.layout.update_metrics(version - 1)
            if upd.is_file():
                u = json.loads(upd.read_text())
                for k in ("reward_mean", "loss", "entropy", "kl", "grad_norm", "sigma", "lr", "kept_samples"):
                    if k in u:
                        add(f"adapter.update.{k}", u[k])

        # provenance (run-dependent: flow run, timing, host)
        for k, v in sorted(read_provenance(path).items()):
            add(f"provenance.{k}", v)

        # params and config hash
        cfg_file = next((p for p in (self.root / "params.yaml", self.layout.config) if p.is_file()), None)
        add("config.file", str(cfg_file) if cfg_file else "")
        if cfg_file is not None:
            add("config.hash_matches_file", self._config_hash(cfg_file) == meta.get("config_hash"))
        lock = self._dvc_lock_entry(f"rollout@{step}")
        if lock is not None:
            add("dvc.stage", f"rollout@{step}")
            add("dvc.cmd", lock.get("cmd", ""))
            for o in lock.get("outs", []):
                if Path(o.get("path", "")).name == path.name:
                    add("dvc.out_md5", o.get("md5"))
                    add("dvc.out_md5_matches_file", o.get("md5") == _md5(path))
            for d in lock.get("deps", []):
                if str(d.get("path", "")).startswith(("adapters/", "models/", "data/")):
                    add(f"dvc.dep.{d['path']}", d.get("md5"))
            params = {}
            for _file, values in (lock.get("params") or {}).items():
                params.update(_flatten(values))
            for k in sorted(params):
                add(f"param.{k}", params[k])
        elif cfg_file is not None:
            import yaml

            tree = yaml.safe_load(cfg_file.read_text()) or {}
            flat = _flatten({k: tree.get(k) for k in ("run", "model", "lora", "rollout", "aqn") if k in tree})
            for k in sorted(flat):
                add(f"param.{k}", flat[k])
        add("git.commit_now", _git_head(self.root))
        return Result(["field", "value"], out, title=f"lineage of rollout@{step} row {row}", workspace=self.where)

    def _config_hash(self, cfg_file: Path) -> str | None:
        try:
            from qerl_lib.config import config_hash, load_config

            cfg = load_config(cfg_file)
        except Exception:  # noqa: BLE001 - an unreadable config only means "cannot compare"
            return None
        return config_hash(cfg)

    def _dvc_lock_entry(self, stage: str) -> dict | None:
        import yaml

        lock = self.root / "dvc.lock"
        if not lock.is_file():
            return None
        try:
            data = yaml.safe_load(lock.read_text()) or {}
        except yaml.YAMLError:
            return None
        return (data.get("stages") or {}).get(stage)


def _git_head(root: Path) -> str:
    import subprocess

    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
                             env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    except (OSError, subprocess.SubprocessError):
        return ""
    return res.stdout.strip() if res.returncode == 0 else ""


def _duck_type(t) -> str:
    import pyarrow as pa

    if pa.types.is_list(t):
        return _duck_type(t.value_type) + "[]"
    return {
        pa.int32(): "integer", pa.int64(): "bigint", pa.float32(): "float", pa.float64(): "double",
        pa.string(): "varchar", pa.bool_(): "boolean",
    }.get(t, "varchar")
