"""Forms of the dashboard pages. They parse what a person types (args as a shell line,
env as KEY=VALUE lines) into a job spec; jobs.services.job_submit validates it, and
its ValidationError is put back on the form, at the field it names."""
import shlex

from django import forms

from fleet.accelerator_types import ACCELERATOR_TYPE_CHOICES
from fleet.models import NODE_DRAIN_REASON_MAX_LENGTH
from jobs.models import Job, Tier
from jobs.services import MAX_TOTAL_STEPS, MAX_WORLD_SIZE


class JobSubmitForm(forms.Form):
    team = forms.ChoiceField()
    name = forms.CharField(max_length=200, help_text="A short label, e.g. resnet50-imagenet.")
    entrypoint = forms.CharField(max_length=1000, help_text="The script or module to run, e.g. train.py.")
    args = forms.CharField(required=False, help_text='Arguments as on a shell line, e.g. --epochs 3 --lr "0.1"')
    world_size = forms.IntegerField(
        label="W (logical ranks)", initial=4, min_value=1, max_value=MAX_WORLD_SIZE,
        help_text="Never changes, whatever the devices.",
    )
    min_devices = forms.IntegerField(initial=1, min_value=1, max_value=MAX_WORLD_SIZE,
                                     help_text="Fewest devices it may run on; must divide W.")
    tier = forms.ChoiceField(choices=Tier.choices, initial=Tier.STANDARD)
    accelerator_type = forms.ChoiceField(choices=ACCELERATOR_TYPE_CHOICES)
    total_steps = forms.IntegerField(required=False, min_value=1, max_value=MAX_TOTAL_STEPS,
                                     help_text="Optional; lets the page show progress as a fraction.")
    env = forms.CharField(
        required=False, widget=forms.Textarea(attrs={"rows": 3}), help_text="One KEY=VALUE per line."
    )
    if_resume_refused = forms.ChoiceField(
        label="If a resume is refused", choices=Job.ResumeRefused.choices, initial=Job.ResumeRefused.FAIL,
        required=False,
        help_text="When the framework checkpoint engine finds the re-run is not the run that was cut (an unseeded "
                  "script, the script's own snapshots): fail the job, or start it again from scratch (said in its "
                  "events; a job spanning hosts always fails).",
    )
    network = forms.ChoiceField(
        label="Network", choices=Job.Network.choices, initial=Job.Network.ISOLATED, required=False,
        help_text="Isolated: the ranks reach nothing outside the job (loopback only). The node's network (to "
                  "download data) only where the operator allows it. A job spanning hosts gets the node's "
                  "network, said in its events.",
    )
    bundle = forms.FileField(
        required=False, label="Code bundle (.tar.gz)",
        help_text="Your project folder packed (tar czf project.tar.gz -C my-project .; `meridian submit` does it "
                  "for you); the entrypoint is then a path inside it. Leave empty to run an entrypoint on the node.",
    )

    def __init__(self, *args, teams, **kwargs):
        super().__init__(*args, **kwargs)
        self.teams = {str(team.pk): team for team in teams}
        self.fields["team"].choices = [(str(team.pk), team.name) for team in teams]
        if len(teams) == 1:
            self.fields["team"].initial = str(teams[0].pk)

    def clean_args(self):
        try:
            return shlex.split(self.cleaned_data["args"] or "")
        except ValueError as error:
            raise forms.ValidationError(f"could not split the arguments like a shell would: {error}") from error

    def clean_env(self):
        env = {}
        for number, line in enumerate((self.cleaned_data["env"] or "").splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise forms.ValidationError(f"line {number} ({line!r}) is not KEY=VALUE")
            key, value = line.split("=", 1)
            env[key.strip()] = value
        return env

    def team_chosen(self):
        return self.teams[self.cleaned_data["team"]]

    def spec(self):
        """Returns the job spec dict for jobs.services.job_submit."""
        data = self.cleaned_data
        fields = ("name", "entrypoint", "args", "world_size", "min_devices", "tier", "accelerator_type", "env")
        spec = {field: data[field] for field in fields}
        if data.get("total_steps") is not None:
            spec["total_steps"] = data["total_steps"]
        if data.get("if_resume_refused"):  # left empty (a form posted without it): the service's default
            spec["if_resume_refused"] = data["if_resume_refused"]
        if data.get("network"):  # likewise
            spec["network"] = data["network"]
        return spec

    def bundle_upload(self, *, user):
        """Stores the uploaded archive (jobs.bundles) and returns its digest, or None without one;
        a refused archive is put on the bundle field and None returned with the form invalid."""
        from jobs.bundles import BundleTooLarge, bundle_store_upload

        uploaded = self.cleaned_data.get("bundle")
        if not uploaded:
            return None
        try:
            return bundle_store_upload(uploaded_file=uploaded, user=user).sha256
        except BundleTooLarge as error:
            self.add_error("bundle", str(error))
        except forms.ValidationError as error:
            for message in getattr(error, "messages", [str(error)]):
                self.add_error("bundle", message)
        return None

    def add_service_errors(self, error):
        """Puts a service ValidationError on the fields it names (unknown names on the form)."""
        if hasattr(error, "message_dict"):
            for field, messages in error.message_dict.items():
                target = field if field in self.fields else None
                for message in messages:
                    self.add_error(target, message)
        else:
            for message in error.messages:
                self.add_error(None, message)


class PreemptionDecisionForm(forms.Form):
    decision = forms.ChoiceField(choices=[("approve", "Approve"), ("deny", "Deny")])
    note = forms.CharField(required=False, max_length=2000, widget=forms.Textarea(attrs={"rows": 2}))


class NodeDrainForm(forms.Form):
    reason = forms.CharField(max_length=NODE_DRAIN_REASON_MAX_LENGTH,
                             widget=forms.TextInput(attrs={"placeholder": "why, e.g. replace GPU 3 (ticket 1234)"}))
