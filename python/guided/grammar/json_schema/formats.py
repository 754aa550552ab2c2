"""String formats: which llguidance implements, and a regex for (a subset of) the others.

JSON Schema treats an unknown format as an annotation; formats the specification
defines but llguidance lacks are rewritten to a pattern or to a narrower known format.
"""
from __future__ import annotations


# Formats llguidance 1.9 implements (src/json/formats.rs); others are annotations.
KNOWN_FORMATS = frozenset({
    "date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
    "unknown",
})

# Formats JSON Schema defines that llguidance lacks: a regex for (a subset of) each.
_PCHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})"
_SEG_NC = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=@]|%[0-9A-Fa-f]{2})"
_QUERY = r"(?:" + _PCHAR + r"|[/?])*"
RELATIVE_REF = (r"(?:/(?:" + _PCHAR + r"+(?:/" + _PCHAR + r"*)*)?|" + _SEG_NC + r"+(?:/" + _PCHAR
                 + r"*)*)?(?:\?" + _QUERY + r")?(?:#" + _QUERY + r")?")
_TPL_LIT = r"(?:[!#$&()*+,\-./0-9:;=?@A-Z\[\]_a-z~]|%[0-9A-Fa-f]{2})"
_TPL_VARCHAR = r"(?:[A-Za-z0-9_]|%[0-9A-Fa-f]{2})"
_TPL_VARSPEC = _TPL_VARCHAR + r"(?:\.?" + _TPL_VARCHAR + r")*(?::[1-9][0-9]{0,3}|\*)?"
FORMAT_PATTERNS = {
    "uri-template": r"^(?:" + _TPL_LIT + r"|\{[+#./;?&=,!@|]?" + _TPL_VARSPEC + r"(?:," + _TPL_VARSPEC
                    + r")*\})*$",
    "json-pointer": r"^(?:/(?:[^/~]|~[01])*)*$",
    "relative-json-pointer": r"^(?:0|[1-9][0-9]*)(?:#|(?:/(?:[^/~]|~[01])*)*)$",
    "regex": r"^(?:[^\\^$|?*+()\[\]{}]|\\[\\^$.|?*+()\[\]{}/dDwWsS])*$",
}
FORMAT_ALIASES = {  # a subset of the named format that llguidance implements
    "idn-email": "email", "idn-hostname": "hostname", "iri": "uri",
}
REFERENCE_FORMATS = {"uri-reference", "iri-reference"}
