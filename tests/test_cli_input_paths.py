"""wicore.cli.input_paths: what INPUT arguments expand to. Every file in a folder gets an item
(hidden ones aside), every manifest line too; a missing argument is an error up front."""

from __future__ import annotations

import json

import pytest

from tests.helpers import write_images
from wicore.cli.input_paths import expand_inputs
from wicore.errors import ConfigError


def test_a_folder_gives_every_file_an_item_and_unsupported_ones_an_error(tmp_path):
    write_images(tmp_path / "photos" / "deep", 2)
    (tmp_path / "photos" / "notes.txt").write_text("text")
    (tmp_path / "photos" / "list.jsonl").write_text("{}")
    (tmp_path / "photos" / ".DS_Store").write_text("hidden")
    (tmp_path / "photos" / ".cache").mkdir()
    (tmp_path / "photos" / ".cache" / "x.png").write_bytes(b"hidden too")
    items = {item.input: item for item in expand_inputs([str(tmp_path / "photos")])}
    images = {str(tmp_path / "photos" / "deep" / f"img000{i}.png") for i in range(2)}
    others = {str(tmp_path / "photos" / name) for name in ("notes.txt", "list.jsonl")}
    assert set(items) == images | others
    assert all(items[key].error is None and items[key].path is not None for key in images)
    for key in others:
        assert items[key].path is None and items[key].error == (
            f"InputError: {key}: not an image file (supported: .bmp .gif .heic .heif .jpeg .jpg .png .tif .tiff .webp)"
        )


def test_manifest_lines_each_get_an_item(tmp_path):
    [image] = write_images(tmp_path, 1)
    lines = [
        {"image": image.name, "prompt": "What color?", "max_new_tokens": 5, "input": "first", "metadata": {"shop": 7}},
        {"image": "missing.png"},
        {"metadata": {"shop": "no image, prompt or messages"}},
        {"image": image.name, "max_new_tokens": 0},
        {"image": image.name, "shop": 7},
        {"image": image.name, "temperature": 0.5, "params": {"temperature": 0.7}},
        {"image": image.name, "params": {"top_p": 0}},
    ]
    manifest = tmp_path / "batch.jsonl"
    manifest.write_text("\n".join([*map(json.dumps, lines), "{not json", "", "[1, 2]"]) + "\n")
    items = expand_inputs([str(manifest)])
    first = items[0]
    assert (first.input, first.path, first.prompt, first.params) == (
        "first",
        image,
        "What color?",
        {"max_new_tokens": 5},
    )
    assert first.metadata == {"shop": 7} and first.error is None
    errors = [item.error for item in items[1:]]
    see = "; see `wicore schema manifest`)"
    assert errors == [
        f"InputError: missing.png: no such file ({manifest}:2)",
        f"InputError: {manifest}:3: not a manifest line (give an image, a prompt or messages{see}",
        f"InputError: {manifest}:4: not a manifest line (max_new_tokens: Input should be greater than or equal to 1{see}",
        f"InputError: {manifest}:5: not a manifest line (shop: unknown key (put your own keys under metadata){see}",
        f"InputError: {manifest}:6: not a manifest line (temperature given both at the top level and under params{see}",
        f"InputError: {manifest}:7: not a manifest line (params.top_p: Input should be greater than 0{see}",
        f"InputError: {manifest}:8: not a manifest line (invalid JSON: Expecting property name enclosed in double "
        f"quotes{see}",
        f"InputError: {manifest}:10: not a manifest line (not a JSON object{see}",
    ]


def test_manifest_generation_parameters_sit_at_the_top_level_or_under_params(tmp_path):
    [image] = write_images(tmp_path, 1)
    lines = [
        {"image": image.name, "temperature": 0.7, "seed": 3, "stop": ".", "top_k": 5, "input": "a"},
        {"image": image.name, "params": {"temperature": 0.7, "seed": 3, "stop": ["."], "top_p": 0.9}, "input": "b"},
    ]
    manifest = tmp_path / "batch.jsonl"
    manifest.write_text("\n".join(map(json.dumps, lines)) + "\n")
    a, b = expand_inputs([str(manifest)])
    assert a.params == {"temperature": 0.7, "seed": 3, "stop": (".",), "top_k": 5}
    assert b.params == {"temperature": 0.7, "seed": 3, "stop": (".",), "top_p": 0.9}
    flags = {"max_new_tokens": 9, "temperature": 0.0}
    assert a.generation(flags).model_dump(exclude_unset=True) == {**a.params, "max_new_tokens": 9}


def test_image_urls_are_items_a_worker_fetches(tmp_path):
    lines = [
        {"image": "https://images.example.com/a.jpg?sig=x", "input": "a"},
        {"image": "s3://bucket/photos/b.jpg"},
        {"image": "ftp://host/c.jpg"},
        {"image": "s3://bucket-only"},
    ]
    manifest = tmp_path / "batch.jsonl"
    manifest.write_text("\n".join(map(json.dumps, lines)) + "\n")
    a, b, ftp, bucket = expand_inputs([str(manifest), "http://127.0.0.1:9/d.png"])[:4]
    assert (a.input, a.url, a.path, a.error) == ("a", "https://images.example.com/a.jpg?sig=x", None, None)
    assert (b.input, b.image) == ("s3://bucket/photos/b.jpg", "s3://bucket/photos/b.jpg")
    assert ftp.error == f"InputError: ftp://host/c.jpg: no such file ({manifest}:3)"  # not a scheme fetched
    assert bucket.error == "InputError: s3://bucket-only: an s3:// URL needs a key: s3://bucket/key"
    [direct] = expand_inputs(["http://127.0.0.1:9/d.png"])
    assert direct.url == "http://127.0.0.1:9/d.png"


def test_manifest_lines_with_messages_name_their_images_in_order(tmp_path):
    first, second = write_images(tmp_path, 2)
    user = {"role": "user", "content": [{"type": "text", "text": "Compare"}, *image_parts(first.name, second.name)]}
    lines = [
        {"messages": [{"role": "system", "content": "Be brief."}, user], "input": "pair"},
        {"prompt": "Text only, please."},
        {"messages": [{"role": "user", "content": image_parts("missing.png")}]},
        {"messages": [user], "prompt": "both"},
        {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
        {"messages": [user, {"role": "assistant", "content": "ok"}]},
        {"messages": [{"role": "assistant", "content": image_parts(first.name)}, user]},
        {"messages": []},
    ]
    manifest = tmp_path / "chat.jsonl"
    manifest.write_text("\n".join(map(json.dumps, lines)) + "\n")
    items = expand_inputs([str(manifest)])
    pair, text = items[0], items[1]
    assert pair.input == "pair" and pair.images == (first, second) and pair.path is None and pair.error is None
    assert [m.role for m in pair.messages] == ["system", "user"] and pair.messages[1].image_count == 2
    assert text.input == f"{manifest}:2" and text.prompt == "Text only, please." and text.image is None
    errors = [item.error for item in items[2:]]
    assert errors[0] == f"InputError: missing.png: no such file ({manifest}:3)"
    expected = [
        "give messages, or image and/or prompt, not both",
        "messages.0.content.0.image: Field required",
        "the last turn must be the user's",
        "messages.0: image parts go in user turns",
        "messages: give at least one turn",
    ]
    for error, words in zip(errors[1:], expected, strict=True):
        assert error.startswith(f"InputError: {manifest}:") and words in error, error


def image_parts(*names: str) -> list[dict]:
    return [{"type": "image", "image": name} for name in names]


def test_a_missing_argument_is_an_error_before_anything_else(tmp_path):
    [image] = write_images(tmp_path, 1)
    with pytest.raises(ConfigError, match=r"^no such file or folder: nope\.png, gone/$"):
        expand_inputs([str(image), "nope.png", "gone/"])


def test_an_input_given_twice_is_one_item(tmp_path):
    [image] = write_images(tmp_path, 1)
    assert [item.input for item in expand_inputs([str(image), str(tmp_path), str(image)])] == [str(image)]


def test_manifest_messages_may_name_files_and_urls_with_generation_keys(tmp_path):
    [image] = write_images(tmp_path, 1)
    url = "https://images.example.com/b.jpg"
    user = {"role": "user", "content": image_parts(image.name, url, "s3://bucket-only")[:2]}
    lines = [
        {"messages": [user], "temperature": 0.5, "params": {"seed": 3}, "metadata": {"shop": 7}},
        {"messages": [{"role": "user", "content": image_parts("s3://bucket-only")}]},
    ]
    manifest = tmp_path / "chat.jsonl"
    manifest.write_text("\n".join(map(json.dumps, lines)) + "\n")
    mixed, bucket = expand_inputs([str(manifest)])
    assert mixed.images == (image, url) and mixed.files == (image,) and mixed.input == image.name
    assert mixed.params == {"temperature": 0.5, "seed": 3} and mixed.metadata == {"shop": 7}
    assert bucket.error == "InputError: s3://bucket-only: an s3:// URL needs a key: s3://bucket/key"
