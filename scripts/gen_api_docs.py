#!/usr/bin/env python3
"""Write docs/api.md, the API reference, from the comments in proto/querator/v1.

It reads the descriptor set that scripts/gen_proto.sh writes with source info
(clients/proto/src/querator/v1/querator_v1.binpb), so the comments in the .proto
files are the single source. `./dev gen` runs it after the code generator;
server/tests/test_api_docs.py fails when the committed docs/api.md differs.

    python scripts/gen_api_docs.py            # write docs/api.md
    python scripts/gen_api_docs.py --check    # exit 1 if docs/api.md is out of date
    python scripts/gen_api_docs.py --stdout   # print instead of writing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[1]
DESCRIPTORS = ROOT / "clients/proto/src/querator/v1/querator_v1.binpb"
OUTPUT = ROOT / "docs/api.md"
PACKAGE = "querator.v1"
FILE_ORDER = ("querator/v1/queue.proto", "querator/v1/queues.proto", "querator/v1/storage.proto")

# Field numbers of the descriptor messages, as used in SourceCodeInfo paths.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM = 2, 3, 4
_ENUM_VALUE, _SERVICE_METHOD = 2, 2

_SCALARS = {
    descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE: "double",
    descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT: "float",
    descriptor_pb2.FieldDescriptorProto.TYPE_INT64: "int64",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT64: "uint64",
    descriptor_pb2.FieldDescriptorProto.TYPE_INT32: "int32",
    descriptor_pb2.FieldDescriptorProto.TYPE_FIXED64: "fixed64",
    descriptor_pb2.FieldDescriptorProto.TYPE_FIXED32: "fixed32",
    descriptor_pb2.FieldDescriptorProto.TYPE_BOOL: "bool",
    descriptor_pb2.FieldDescriptorProto.TYPE_STRING: "string",
    descriptor_pb2.FieldDescriptorProto.TYPE_BYTES: "bytes",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT32: "uint32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SFIXED32: "sfixed32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SFIXED64: "sfixed64",
    descriptor_pb2.FieldDescriptorProto.TYPE_SINT32: "sint32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SINT64: "sint64",
}
_WELL_KNOWN = "https://protobuf.dev/reference/protobuf/google.protobuf/#"


def _comment(text: str) -> str:
    """A proto comment as markdown: one leading space off each line, ends trimmed."""
    lines = [line.removeprefix(" ") for line in text.split("\n")]
    return "\n".join(lines).strip()


def _cell(text: str) -> str:
    return " ".join(_comment(text).split()).replace("|", "\\|")


def _anchor(name: str) -> str:
    return name.lower().replace(".", "")


class Generator:
    def __init__(self, files: list[descriptor_pb2.FileDescriptorProto]) -> None:
        # The queue API first, then the rest by file name.
        order = {name: i for i, name in enumerate(FILE_ORDER)}
        self.files = sorted(
            (f for f in files if f.package == PACKAGE), key=lambda f: (order.get(f.name, len(order)), f.name)
        )
        self.comments: dict[tuple[str, tuple[int, ...]], str] = {}
        self.local: set[str] = set()
        self.maps: dict[str, tuple[descriptor_pb2.FieldDescriptorProto, descriptor_pb2.FieldDescriptorProto]] = {}
        for f in self.files:
            for loc in f.source_code_info.location:
                if loc.leading_comments:
                    self.comments[(f.name, tuple(loc.path))] = loc.leading_comments
            for message, _path, full in self._messages(f):
                self.local.add(full)
                if message.options.map_entry:
                    self.maps[full] = (message.field[0], message.field[1])
            for _enum, _path, full in self._enums(f):
                self.local.add(full)

    # -- walking -----------------------------------------------------------------------

    def _messages(
        self, f: descriptor_pb2.FileDescriptorProto
    ) -> list[tuple[descriptor_pb2.DescriptorProto, tuple[int, ...], str]]:
        out = []

        def walk(message: descriptor_pb2.DescriptorProto, path: tuple[int, ...], prefix: str) -> None:
            full = f"{prefix}.{message.name}"
            out.append((message, path, full))
            for i, nested in enumerate(message.nested_type):
                walk(nested, (*path, _MESSAGE_NESTED, i), full)

        for i, message in enumerate(f.message_type):
            walk(message, (_FILE_MESSAGE, i), f".{f.package}")
        return out

    def _enums(
        self, f: descriptor_pb2.FileDescriptorProto
    ) -> list[tuple[descriptor_pb2.EnumDescriptorProto, tuple[int, ...], str]]:
        out = [(e, (_FILE_ENUM, i), f".{f.package}.{e.name}") for i, e in enumerate(f.enum_type)]
        for message, path, full in self._messages(f):
            out += [(e, (*path, _MESSAGE_ENUM, i), f"{full}.{e.name}") for i, e in enumerate(message.enum_type)]
        return out

    def _doc(self, f: descriptor_pb2.FileDescriptorProto, path: tuple[int, ...]) -> str:
        return self.comments.get((f.name, path), "")

    # -- names and types ----------------------------------------------------------------

    def _short(self, full: str) -> str:
        return full.removeprefix(f".{PACKAGE}.")

    def _type_link(self, full: str) -> str:
        if full in self.local:
            short = self._short(full)
            return f"[{short}](#{_anchor(short)})"
        name = full.lstrip(".")
        if name.startswith("google.protobuf."):
            return f"[{name}]({_WELL_KNOWN}{name.rsplit('.', 1)[1].lower()})"
        return f"`{name}`"

    def _field_type(self, field: descriptor_pb2.FieldDescriptorProto) -> str:
        if field.type_name in self.maps:
            key, value = self.maps[field.type_name]
            return f"map<{self._field_type(key)}, {self._field_type(value)}>"
        if field.type in _SCALARS:
            base = f"`{_SCALARS[field.type]}`"
        else:
            base = self._type_link(field.type_name)
        if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
            return f"repeated {base}"
        if field.proto3_optional:
            return f"optional {base}"
        return base

    # -- output -------------------------------------------------------------------------

    def render(self) -> str:
        out: list[str] = [
            f"# API reference: `{PACKAGE}`",
            "",
            "<!-- Generated by scripts/gen_api_docs.py from the comments in proto/querator/v1/*.proto.",
            "     Do not edit: change the .proto comments, then run ./dev gen. -->",
            "",
            "Generated from the comments in [`proto/querator/v1/`](../proto/querator/v1); the same",
            "text is served by reflection (`grpcurl describe`, see [grpcurl.md](grpcurl.md)). How",
            "the server applies these calls: [architecture.md](architecture.md).",
            "",
            "## Services",
            "",
        ]
        for f in self.files:
            for service in f.service:
                out.append(f"- [{service.name}](#{_anchor(service.name)}) (`{f.name}`)")
        out.append("")
        for f in self.files:
            for i, service in enumerate(f.service):
                out += self._service(f, i, service)
        out += ["## Messages", ""]
        for f in self.files:
            for message, path, full in self._messages(f):
                if not message.options.map_entry:
                    out += self._message(f, path, full, message)
        enums = [(f, e, path, full) for f in self.files for e, path, full in self._enums(f)]
        if enums:
            out += ["## Enums", ""]
            for f, enum, path, full in enums:
                out += self._enum(f, path, full, enum)
        while out and not out[-1]:
            out.pop()
        return "\n".join(out) + "\n"

    def _service(
        self, f: descriptor_pb2.FileDescriptorProto, index: int, service: descriptor_pb2.ServiceDescriptorProto
    ) -> list[str]:
        path = (_FILE_SERVICE, index)
        out = [f"### {service.name}", "", f"`{PACKAGE}.{service.name}`, in `proto/{f.name}`.", ""]
        doc = _comment(self._doc(f, path))
        if doc:
            out += [doc, ""]
        out += ["| Method | Request | Response |", "|---|---|---|"]
        for method in service.method:
            out.append(
                f"| [{method.name}](#{_anchor(service.name + method.name)}) | "
                f"{self._type_link(method.input_type)} | {self._type_link(method.output_type)} |"
            )
        out.append("")
        for j, method in enumerate(service.method):
            # The heading text makes a unique anchor: servicename + methodname.
            out += [
                f"#### {service.name}.{method.name}",
                "",
                f"`rpc {method.name}({self._short(method.input_type)}) returns ({self._short(method.output_type)})`",
                "",
            ]
            doc = _comment(self._doc(f, (*path, _SERVICE_METHOD, j)))
            if doc:
                out += [doc, ""]
        return out

    def _heading(self, f: descriptor_pb2.FileDescriptorProto, path: tuple[int, ...], full: str) -> list[str]:
        """A message's or an enum's heading (its short name: the anchor), then its comment."""
        out = [f"### {self._short(full)}", ""]
        doc = _comment(self._doc(f, path))
        if doc:
            out += [doc, ""]
        return out

    def _message(
        self,
        f: descriptor_pb2.FileDescriptorProto,
        path: tuple[int, ...],
        full: str,
        message: descriptor_pb2.DescriptorProto,
    ) -> list[str]:
        out = self._heading(f, path, full)
        if not message.field:
            return [*out, "No fields.", ""]
        out += ["| Field | Type | Description |", "|---|---|---|"]
        real_oneofs = {
            field.oneof_index for field in message.field if field.HasField("oneof_index") and not field.proto3_optional
        }
        for k, field in enumerate(message.field):
            description = _cell(self._doc(f, (*path, _MESSAGE_FIELD, k)))
            if field.HasField("oneof_index") and field.oneof_index in real_oneofs:
                description = f"(one of `{message.oneof_decl[field.oneof_index].name}`) {description}".strip()
            out.append(f"| `{field.name}` = {field.number} | {self._field_type(field)} | {description} |")
        return [*out, ""]

    def _enum(
        self,
        f: descriptor_pb2.FileDescriptorProto,
        path: tuple[int, ...],
        full: str,
        enum: descriptor_pb2.EnumDescriptorProto,
    ) -> list[str]:
        out = self._heading(f, path, full)
        out += ["| Value | Number | Description |", "|---|---|---|"]
        for k, value in enumerate(enum.value):
            out.append(f"| `{value.name}` | {value.number} | {_cell(self._doc(f, (*path, _ENUM_VALUE, k)))} |")
        return [*out, ""]


def generate(descriptors: Path = DESCRIPTORS) -> str:
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(descriptors.read_bytes())
    return Generator(list(fds.file)).render()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/api.md is out of date")
    mode.add_argument("--stdout", action="store_true", help="print the reference instead of writing it")
    parser.add_argument("--descriptors", type=Path, default=DESCRIPTORS, help="descriptor set with source info")
    args = parser.parse_args(argv)
    text = generate(args.descriptors)
    if args.stdout:
        sys.stdout.write(text)
    elif args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print("docs/api.md is out of date: run ./dev gen (or python scripts/gen_api_docs.py)", file=sys.stderr)
            return 1
    else:
        OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
