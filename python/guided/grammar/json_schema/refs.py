"""$ref resolution: each sub-schema's draft and base URI, resources, anchors, and the one
``$defs`` table every reference is rewritten to (``#/$defs/rN``, walked once)."""
from __future__ import annotations

from typing import Any

from .vocabulary import DRAFTS


ROOT_URI = "https://root.invalid/schema.json"


class Unsupported(Exception):
    """A construct with no rewrite (a reference out of the schema, a recursion being walked)."""


def pointer_escape(name: str) -> str:
    """A property name as one JSON-pointer segment (for the paths in notes)."""
    return name.replace("~", "~0").replace("/", "~1")


class Ctx:
    """Where a sub-schema sits: its draft and base URI."""
    __slots__ = ("draft", "base")

    def __init__(self, draft: int, base: str):
        self.draft, self.base = draft, base


def join_uri(base: str, ref: str) -> str:
    from urllib.parse import urljoin
    if ref.startswith("json-schema:///"):  # llguidance's default base
        ref = ref[len("json-schema:///"):]
    return urljoin(base, ref)


class Refs:
    """Reference bookkeeping of the Sanitizer (it provides ``walk``)."""

    # set by Analysis.disjoint: a definition still being walked resolves to its raw schema
    _raw = False

    def _node_ctx(self, node: dict, ctx: Ctx) -> Ctx:
        draft, base = ctx.draft, ctx.base
        sch = node.get("$schema")
        if isinstance(sch, str):
            draft = DRAFTS.get(sch.rstrip("#").replace("https://json-schema.org/draft-0",
                                                         "http://json-schema.org/draft-0"), 2020)
        nid = node.get("id") if draft == 4 else node.get("$id")
        if isinstance(nid, str) and nid and not (draft >= 2019 and nid.startswith("#")):
            if nid.startswith("#"):
                self.anchors[join_uri(base, nid)] = node
            else:
                base = join_uri(base, nid).split("#")[0]
        if draft == draft and (draft, base) == (ctx.draft, ctx.base):
            return ctx
        return Ctx(draft, base)

    def _index(self, node: Any, ctx: Ctx, top: bool = False) -> Ctx:
        """Record every sub-schema's draft and base URI, resources and anchors."""
        if not isinstance(node, dict):
            return ctx
        nctx = self._node_ctx(node, ctx)
        self.ctx[id(node)] = nctx
        if top or nctx.base != ctx.base:
            self.resources.setdefault(nctx.base, (node, nctx))
        if top:
            self.resources.setdefault(ROOT_URI, (node, nctx))
        if isinstance(node.get("$anchor"), str):
            self.anchors[nctx.base + "#" + node["$anchor"]] = node
        for k, v in node.items():
            if k in ("enum", "const", "examples", "default"):
                continue
            if k in ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas",
                     "dependencies"):
                if isinstance(v, dict):
                    for sub in v.values():
                        self._index(sub, nctx)
            elif isinstance(v, dict):
                self._index(v, nctx)
            elif isinstance(v, list):
                for sub in v:
                    self._index(sub, nctx)
        return nctx

    def target(self, ref: str, ctx: Ctx) -> tuple[Any, Ctx]:
        """The (original) schema a ref points at and its context, or raise Unsupported."""
        from urllib.parse import unquote
        absolute = join_uri(ctx.base, ref)
        doc, _, frag = absolute.partition("#")
        if doc not in self.resources:
            raise Unsupported(f"$ref {ref!r} points outside the schema")
        node, rctx = self.resources[doc]
        frag = unquote(frag)
        if frag in ("", "/"):
            return node, rctx
        if not frag.startswith("/"):
            found = self.anchors.get(doc + "#" + frag)
            if found is None:
                raise Unsupported(f"$ref {ref!r}: no such anchor")
            return found, self.ctx.get(id(found), rctx)
        for part in frag[1:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise Unsupported(f"$ref {ref!r} does not resolve")
        return node, self.ctx.get(id(node), rctx)

    def ref_name(self, ref: str, ctx: Ctx) -> str:
        node, tctx = self.target(ref, ctx)
        key = id(node)
        if key not in self.def_names:
            name = f"r{len(self.def_names)}"
            self.def_names[key] = name
            self.def_nodes[name] = node
            self.queue.append((node, tctx, name))
        return self.def_names[key]

    def resolve(self, ref: str) -> Any:
        """The sanitised schema a rewritten ref ("#/$defs/rN") points at (walked on first use;
        Unsupported while it is still being walked, i.e. for a recursive reference)."""
        if ref.startswith("#/$defs/"):
            name = ref[len("#/$defs/"):]
            if name in self.defs:
                return self.defs[name]
            if name in self.in_progress:
                if self._raw:
                    return self.def_nodes[name]
                raise Unsupported("recursive reference")
            for i, (node, nctx, qname) in enumerate(self.queue):
                if qname == name:
                    del self.queue[i]
                    return self._walk_def(node, nctx, name)
        raise Unsupported(f"$ref {ref!r} unknown")

    def _walk_def(self, node, ctx, name):
        self.in_progress.add(name)
        try:
            self.defs[name] = self.walk(node, f"#(ref {name})", ctx)
        finally:
            self.in_progress.discard(name)
        return self.defs[name]
