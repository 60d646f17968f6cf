"""The pages' WebSocket: ws/live/.

A logged-in browser connects, then asks for the groups its page needs:

    → {"subscribe": ["fleet", "job.12", "team.3", "approvals"]}
    ← {"type": "subscribed", "groups": ["fleet", "job.12", "team.3"], "refused": ["approvals"]}

A user joins only groups they may see: "fleet" (anyone logged in), "team.<id>" of their
teams, "job.<id>" of their teams' jobs, "approvals" when they manage some team.

Close codes (the socket is accepted first, so a browser sees the code, not an HTTP 403):
  4401  the socket is anonymous (log in first)
  4400  a frame that is not a JSON text frame (binary, or text that does not parse)

Pushes from fleet.live.events_publish arrive as channel messages and go to the browser
as JSON with the same "type". The fleet group carries every team's job updates; a
browser gets the job's details only when the job is on one of its user's teams, else
just {"type": "fleet.changed"} (the heatmap refetches; nothing about the job leaks).
Unknown "fleet.*" messages (e.g. node or telemetry updates from the control loop) are
passed on as {"type": "fleet.changed"} too; other unknown types are dropped and logged.
"""
import logging

from channels.consumer import get_handler_name
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from fleet.live import GROUP_APPROVALS, GROUP_FLEET
from jobs.models import Job
from jobs.selectors import approver_team_ids, team_ids_for_user

logger = logging.getLogger(__name__)

CLOSE_UNAUTHENTICATED = 4401
CLOSE_BAD_FRAME = 4400
MAX_GROUPS_PER_SOCKET = 200
MAX_ID_DIGITS = 18  # "job.<id>" / "team.<id>": ids fit a 64-bit column


@database_sync_to_async
def _teams_of(user):
    return set(team_ids_for_user(user)), approver_team_ids(user=user)


@database_sync_to_async
def _job_team(job_id):
    return Job.objects.filter(pk=job_id).values_list("team_id", flat=True).first()


class LiveConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            # accept, then close: closing during the handshake reaches the browser as HTTP 403
            # with no code to tell "log in" from any other refusal
            await self.accept()
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.user = user
        self.team_ids, self.approver_team_ids = await _teams_of(user)
        self.groups_joined = set()
        await self.accept()

    async def disconnect(self, code):
        for group in getattr(self, "groups_joined", ()):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None, **kwargs):
        """Decodes a JSON text frame for receive_json; anything else closes with CLOSE_BAD_FRAME
        (after an error message saying what to send), never an exception (which would be 1011)."""
        if text_data is None:
            await self._refuse_frame("binary frames are not understood; send JSON text")
            return
        try:
            content = await self.decode_json(text_data)
        except (ValueError, RecursionError):
            await self._refuse_frame("the frame is not JSON")
            return
        await self.receive_json(content, **kwargs)

    async def _refuse_frame(self, why):
        await self.send_json({"type": "error", "error": f'{why}: send {{"subscribe": ["fleet", "job.<id>"]}}'})
        await self.close(code=CLOSE_BAD_FRAME)

    async def receive_json(self, content, **kwargs):
        if not isinstance(content, dict) or not isinstance(content.get("subscribe"), list):
            await self.send_json(
                {"type": "error", "error": 'send {"subscribe": ["fleet", "job.<id>", "team.<id>", "approvals"]}'}
            )
            return
        joined, refused = [], []
        for group in content["subscribe"][:MAX_GROUPS_PER_SOCKET]:
            if isinstance(group, str) and await self._may_join(group):
                if group not in self.groups_joined:
                    await self.channel_layer.group_add(group, self.channel_name)
                    self.groups_joined.add(group)
                joined.append(group)
            else:
                refused.append(group)
        await self.send_json({"type": "subscribed", "groups": joined, "refused": refused})

    async def _may_join(self, group):
        if group == GROUP_FLEET:
            return True
        if group == GROUP_APPROVALS:
            return bool(self.approver_team_ids)
        kind, _, ident = group.partition(".")
        # isascii: "²".isdigit() is true, but int() refuses it
        if not (ident.isascii() and ident.isdigit() and len(ident) <= MAX_ID_DIGITS):
            return False
        if kind == "team":
            return int(ident) in self.team_ids
        if kind == "job":
            return await _job_team(int(ident)) in self.team_ids
        return False

    # --- pushes -----------------------------------------------------------------------

    async def jobs_job_updated(self, event):
        job = event.get("job") or {}
        if job.get("team_id") in self.team_ids:
            await self.send_json({"type": "jobs.job_updated", "job": job})
        elif GROUP_FLEET in self.groups_joined:
            await self.send_json({"type": "fleet.changed"})

    async def jobs_preemption_updated(self, event):
        preemption = event.get("preemption") or {}
        team_id = await _job_team(preemption.get("job_id"))
        if team_id in self.team_ids:
            await self.send_json({"type": "jobs.preemption_updated", "preemption": preemption})

    async def dispatch(self, message):
        # Channels raises on a message type without a handler, which would close the socket;
        # the control loop may add message types this page does not know yet.
        if getattr(self, get_handler_name(message), None) is None:
            if message.get("type", "").startswith("fleet.") and GROUP_FLEET in getattr(self, "groups_joined", ()):
                await self.send_json({"type": "fleet.changed"})
            else:
                logger.debug("live socket dropped a %r message it has no handler for", message.get("type"))
            return
        await super().dispatch(message)
