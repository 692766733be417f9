"""``raytrain-loops convert``: an ImageFolder tree and a COCO directory written by the tests
(tests/support/vision_data.py), converted on Ray Data into the Parquet the plan reads, locally and in a
bucket (moto's S3 server); the COCO round trip against pycocotools; bad input named before
anything is written; the data set's identity (raytrain_loops/data/formats/identity.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raytrain_loops import cli
from raytrain_loops.data.formats import identity
from raytrain_loops.data.formats.coco import decode_mask
from raytrain_loops.data.formats.layout import SourceError, read_meta
from raytrain_loops.tools.convert import convert
from tests.support.s3 import s3_server  # noqa: F401  (the fixture)
from tests.support.vision_data import CLASSES, write_coco, write_imagefolder


def _parts(dest: Path, split: str = "train") -> list[Path]:
    return sorted((dest / split).glob("part-*.parquet"))


def test_an_imagefolder_is_converted_whole_and_a_rerun_over_the_same_source_is_a_no_op(ray_session, tmp_path):
    src = write_imagefolder(tmp_path / "folder", per_class=100, size=12)
    (src / "circle" / "notes.txt").write_text("not an image")
    dest = tmp_path / "converted"
    said = []
    summary = convert("imagefolder", str(src), str(dest), chunk_rows=64, rows_per_file=256, say=said.append)
    assert (summary.images, summary.files, summary.converted) == (300, 2, True)
    assert summary.skipped == [["circle/notes.txt", "not an image: its header is no image format's"]]
    assert "skipped circle/notes.txt: not an image" in said[-1]
    assert summary.line().startswith("converted 300 images, 3 classes, ") and "1 file skipped" in summary.line()
    files = _parts(dest)
    groups = [[pq.ParquetFile(f).metadata.row_group(i).num_rows for i in range(pq.ParquetFile(f).num_row_groups)] for f in files]
    # Row groups of data.shuffle_chunk_rows; the first file's 256 source files held the one skipped.
    assert groups == [[64, 64, 64, 63], [45]]
    table = pq.read_table(dest / "train").to_pylist()
    assert [r["path"] for r in table] == sorted(r["path"] for r in table)  # the source's order, class by class
    for r in table:
        assert r["image"] == (src / r["path"]).read_bytes()  # no decode, no re-encode
        assert CLASSES[r["label"]] == r["path"].split("/")[0]
        assert (r["width"], r["height"], r["channels"]) == (12, 12, 3)
    meta = read_meta(str(dest))
    assert meta["classes"] == list(CLASSES) and meta["splits"] == {"train": 300} and meta["channels"] == [3]
    assert meta["digest"] == identity.digest(_without_meta(identity.identity(str(dest))))

    stamps = identity.stamps(str(dest), mtimes=True)
    again = convert("imagefolder", str(src), str(dest), chunk_rows=64, rows_per_file=256, say=said.append)
    assert (again.converted, again.images, again.files) == (False, 300, 2) and "nothing converted" in again.line()
    assert identity.stamps(str(dest), mtimes=True) == stamps  # nothing rewritten
    os.utime(src / "square" / "000.png")  # a changed modification time: converted again
    assert convert("imagefolder", str(src), str(dest), chunk_rows=64, rows_per_file=256).converted
    assert identity.stamps(str(dest)) == {rel: [size] for rel, (size, _) in stamps.items()}  # the same files

    refused = tmp_path / "refused"
    with pytest.raises(SourceError, match=r"--strict: 1 file could not be converted: circle/notes.txt \(not an image"):
        convert("imagefolder", str(src), str(refused), strict=True, say=said.append)
    assert not refused.exists()  # nothing written


def _without_meta(found: dict) -> dict:
    return {"files": {k: v for k, v in found["files"].items() if k != "meta.json"}, "rows": found["rows"]}


def test_the_coco_round_trip_gives_every_box_category_and_mask_pycocotools_gives(ray_session, tmp_path):
    from pycocotools.coco import COCO

    src = write_coco(tmp_path / "coco", images=200)
    dest = tmp_path / "converted"
    summary = convert("coco", str(src), str(dest))
    assert (summary.images, summary.labels, summary.skipped) == (200, "2 categories", [])
    coco = COCO(str(src / "annotations" / "instances_train.json"))
    rows = pq.read_table(dest / "train").to_pylist()
    assert [r["image_id"] for r in rows] == sorted(coco.getImgIds())
    crowds = masks = 0
    for r in rows:
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[r["image_id"]]))
        assert r["image"] == (src / r["path"]).read_bytes()
        assert r["ann_ids"] == [a["id"] for a in anns]
        assert r["category_ids"] == [a["category_id"] for a in anns]
        assert r["iscrowd"] == [a["iscrowd"] for a in anns]
        assert np.asarray(r["boxes"]).reshape(-1, 4).tolist() == [a["bbox"] for a in anns]
        for counts, ann in zip(r["masks"], anns, strict=True):
            expected = coco.annToMask(ann)
            assert expected.sum() > 0 and np.array_equal(decode_mask(counts, r["height"], r["width"]), expected)
            masks += 1
        crowds += sum(r["iscrowd"])
    assert crowds == 1 and masks == len(coco.getAnnIds())
    meta = read_meta(str(dest))
    assert [c["id"] for c in meta["categories"]] == [3, 7] and meta["layout"] == {"train": "train"}


def test_a_source_in_a_bucket_is_converted_into_the_bucket_as_it_is_locally(ray_session, s3_server, tmp_path):  # noqa: F811
    import uuid

    src = write_imagefolder(tmp_path / "folder", per_class=8, size=8)
    root = f"s3://runs/{uuid.uuid4().hex[:8]}"
    query = f"?endpoint_override={s3_server}&scheme=http&region=us-east-1"
    fs, base = pafs.FileSystem.from_uri(root + query)
    pafs.copy_files(str(src), f"{base}/folder", destination_filesystem=fs)
    local = tmp_path / "local"
    convert("imagefolder", str(src), str(local), chunk_rows=8, rows_per_file=16)
    summary = convert("imagefolder", f"{root}/folder{query}", f"{root}/converted{query}", chunk_rows=8, rows_per_file=16)
    assert (summary.images, summary.files) == (24, 2)
    on_store = identity.identity(f"{root}/converted{query}")
    assert _without_meta(on_store) == _without_meta(identity.identity(str(local)))  # the same files, rows and sizes
    meta = json.loads(fs.open_input_stream(f"{base}/converted/meta.json").read())
    assert meta["digest"] == read_meta(str(local))["digest"] and meta["classes"] == list(CLASSES)
    assert not convert("imagefolder", f"{root}/folder{query}", f"{root}/converted{query}", chunk_rows=8, rows_per_file=16).converted


def _edited_coco(src: Path, field: str, index: int, key: str, value: int) -> None:
    """A COCO directory of 3 images whose ``data[field][index][key]`` is ``value``."""
    write_coco(src, images=3)
    path = src / "annotations" / "instances_train.json"
    data = json.loads(path.read_text())
    data[field][index][key] = value
    path.write_text(json.dumps(data))


def _empty_class(src: Path) -> str:
    (src / "circle").mkdir(parents=True)
    (src / "circle" / "a.png").write_bytes(b"x")
    (src / "square").mkdir()
    return f"class directory {src / 'square'} holds no images"


def _missing_image_id(src: Path) -> str:
    _edited_coco(src, "annotations", 0, "image_id", 77)
    return "annotations/instances_train.json: annotation 1 refers to image id 77, not in 'images'"


def _unknown_category(src: Path) -> str:
    _edited_coco(src, "annotations", 1, "category_id", 5)
    return "annotation 2 has category id 5, not in 'categories' [3, 7]"


def _missing_file(src: Path) -> str:
    write_coco(src, images=3)
    (src / "train" / "001003.png").unlink()
    return "image 1003 (001003.png, annotations"


@pytest.mark.parametrize(
    "kind, make", [("imagefolder", _empty_class), ("coco", _missing_image_id), ("coco", _unknown_category), ("coco", _missing_file)]
)
def test_bad_input_is_named_before_anything_is_written(kind, make, tmp_path, capsys):
    src, dest = tmp_path / "src", tmp_path / "dest"
    message = make(src)
    assert cli.main(["convert", kind, str(src), str(dest)]) == 2  # before Ray starts
    err = capsys.readouterr().err
    assert err.startswith("raytrain-loops: error: ") and message in err
    assert not dest.exists()


def test_the_identity_is_paths_sizes_and_rows_and_the_quick_check_adds_modification_times(tmp_path):
    import pyarrow as pa

    pq.write_table(pa.table({"x": list(range(10))}), tmp_path / "a.parquet", row_group_size=4)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"12345")
    (tmp_path / ".hidden").write_text("no")
    (tmp_path / "c.parquet.tmp123").write_text("half")
    found = identity.identity(str(tmp_path))
    assert found["files"] == {"a.parquet": (tmp_path / "a.parquet").stat().st_size, "sub/b.bin": 5}
    assert found["rows"] == {"a.parquet": 10}
    before, quick = identity.digest(found), identity.digest(identity.stamps(str(tmp_path), mtimes=True))
    os.utime(tmp_path / "sub" / "b.bin", ns=(1, 1))  # regenerated alike: the same identity, not the same stamps
    assert identity.digest(identity.identity(str(tmp_path))) == before
    assert identity.digest(identity.stamps(str(tmp_path), mtimes=True)) != quick
    (tmp_path / "sub" / "b.bin").write_bytes(b"123456")
    assert identity.digest(identity.identity(str(tmp_path))) != before
