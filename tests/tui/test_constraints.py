"""A constraint in the chat and the A/B view (specchat/session_constraint.py), through Pilot:
/schema typed in the chat or chosen from the palette, shown in the status line and the A/B header,
carried by every request, JSON replies pretty-printed but copied as written."""
import json

import pytest

from specchat.backends.base import Constraint
from specchat.tui.app import SpecChatApp
from specchat.tui.widgets import AssistantMessage, PathModal
from tests.scripted import ScriptedBackend
from tests.tui.conftest import Loader, ab_open, wait_until

pytestmark = pytest.mark.asyncio

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
JSON_REPLY = '{"name": "Ann", "age": 31}'


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(SCHEMA))
    return path


async def submit(pilot, selector, text):
    pilot.app.screen.query_one(selector).text = text
    await pilot.click(selector)
    await pilot.press("enter")


def status(app) -> str:
    return str(app.chat.query_one("#status-text").render())


def notes(app):
    return [str(n.message) for n in app._notifications]


async def reply_to(pilot, app, prompt):
    before = len(app.conv.messages)
    await submit(pilot, "#prompt", prompt)
    await wait_until(pilot, lambda: len(app.conv.messages) == before + 2 and not app.chat.generating, what="reply")
    await pilot.pause()


async def test_schema_in_the_chat_constrains_the_next_replies_and_shows_in_the_status_line(profiles_dir, schema_file):
    backend = ScriptedBackend([JSON_REPLY])
    app = SpecChatApp("spec", loader=Loader({"spec": backend}), history=False)
    async with app.run_test(size=(110, 30)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None, what="loaded")
        assert "JSON schema" not in status(app)
        await submit(pilot, "#prompt", f"/schema {schema_file}")
        await pilot.pause()
        assert not app.conv.messages  # a command, not a message
        assert app.chat.query_one("#prompt").text == ""
        assert "constraint on: every reply keeps the JSON schema person.json" in notes(app)
        assert "JSON schema person.json on" in status(app)
        await reply_to(pilot, app, "who is Ann?")
        sent = backend.requests[-1].constraint
        assert sent.kind == "json_schema" and json.loads(sent.text) == SCHEMA and sent.origin == str(schema_file)
        # shown indented in a json block; kept, saved and copied as the model wrote it
        reply = app.chat.query(AssistantMessage).last()
        assert reply.markdown() == '```json\n{\n  "name": "Ann",\n  "age": 31\n}\n```'
        assert app.chat.query("MarkdownFence").first().code.strip() == '{\n  "name": "Ann",\n  "age": 31\n}'
        assert app.conv.last_reply == JSON_REPLY
        await pilot.press("ctrl+o")
        assert app.clipboard == JSON_REPLY
        await submit(pilot, "#prompt", "/schema off")
        await pilot.pause()
        assert "JSON schema" not in status(app)
        await reply_to(pilot, app, "again")
        assert backend.requests[-1].constraint is None


async def test_a_schema_that_cannot_be_used_is_one_notification_and_the_one_before_stays(profiles_dir, tmp_path,
                                                                                          schema_file):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "required": "name"}')
    backend = ScriptedBackend([JSON_REPLY])
    app = SpecChatApp("spec", loader=Loader({"spec": backend}), history=False,
                      constraint=Constraint("json_schema", json.dumps(SCHEMA), str(schema_file)))
    async with app.run_test(size=(110, 30)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None, what="loaded")
        assert "JSON schema person.json on" in status(app)  # given at start (the command line's)
        await submit(pilot, "#prompt", f"/schema {bad}")
        await pilot.pause()
        errors = [n for n in app._notifications if n.severity == "error"]
        assert len(errors) == 1 and str(errors[0].message).startswith(f"{bad}: invalid JSON schema")
        await submit(pilot, "#prompt", "/schema")
        await pilot.pause()
        assert f"constraint: JSON schema {schema_file} (set in this session)" in notes(app)
        await reply_to(pilot, app, "who?")
        assert backend.requests[-1].constraint.origin == str(schema_file)


async def test_the_palette_sets_and_clears_the_schema(profiles_dir, schema_file):
    backend = ScriptedBackend(["free text"])
    app = SpecChatApp("spec", loader=Loader({"spec": backend}), history=False)
    async with app.run_test(size=(110, 30)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None, what="loaded")
        assert any(c.title == "JSON schema" for c in app.get_system_commands(app.screen))
        for typed, on in ((str(schema_file), True), ("off", False)):
            app.action_schema()
            await wait_until(pilot, lambda: isinstance(app.screen, PathModal) and app.screen.query("#path-input"),
                             what="path dialog")
            app.screen.query_one("#path-input").value = typed
            await pilot.press("enter")
            await pilot.pause()
            assert ("JSON schema person.json on" in status(app)) is on


async def test_ab_under_a_constraint_says_so_and_judges_both_replies_by_it(profiles_dir, schema_file):
    constraint = Constraint("json_schema", json.dumps(SCHEMA), str(schema_file))
    spec = ScriptedBackend([JSON_REPLY], accept=[2, 1])
    ref = ScriptedBackend([JSON_REPLY])
    app = SpecChatApp("spec", loader=Loader({"spec": spec, "spec:target-only": ref}), history=False,
                      start_ab=True, constraint=constraint)
    async with app.run_test(size=(120, 32)) as pilot:
        await wait_until(pilot, lambda: ab_open(app, ready=True), what="A/B ready")
        ab = app.screen
        assert "JSON schema person.json on" in str(ab.query_one("#ab-header").render())
        await submit(pilot, "#ab-prompt", "who is Ann?")
        await wait_until(pilot, lambda: ab.verdict is not None and not ab.running, what="verdict")
        assert spec.requests[-1].constraint == constraint == ref.requests[-1].constraint
        verdict = str(ab.query_one("#ab-verdict").render())
        assert "both replies keep the JSON schema person.json" in verdict


async def test_ab_names_the_side_whose_reply_breaks_the_constraint(profiles_dir, schema_file):
    constraint = Constraint("json_schema", json.dumps(SCHEMA), str(schema_file))
    spec = ScriptedBackend(['{"name": "Ann"}'], accept=[1])
    ref = ScriptedBackend([JSON_REPLY])
    app = SpecChatApp("spec", loader=Loader({"spec": spec, "spec:target-only": ref}), history=False,
                      start_ab=True, constraint=constraint)
    async with app.run_test(size=(120, 32)) as pilot:
        await wait_until(pilot, lambda: ab_open(app, ready=True), what="A/B ready")
        ab = app.screen
        await submit(pilot, "#ab-prompt", "who is Ann?")
        await wait_until(pilot, lambda: ab.verdict is not None and not ab.running, what="verdict")
        verdict = " ".join(str(ab.query_one("#ab-verdict").render()).split())
        assert "the speculative reply breaks the JSON schema person.json: does not validate: 'age' is a required" \
            in verdict
        assert "reference reply breaks" not in verdict
