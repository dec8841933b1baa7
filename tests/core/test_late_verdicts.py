"""The verdicts of steps decided on the device, arriving late (plugins.ondevice.Verdicts), on a
CPU: a stand-in for the CUDA events that make them late.

On a GPU each step's verdict (0 taken, 1 a non-finite second pass, 2 a non-finite first pass)
is copied to pinned host memory and an event recorded behind the copy; the host reads it once
the event has passed, a step or more later, or waits for it where it must (``nonfinite_steps``,
``state_dict()``, ``load_state_dict()``, a copy).  On the CPU a verdict is there at once.
:class:`PendingEvents` puts the GPU's timing back: every verdict takes the CUDA branch's way,
through a host slot and an event (a stand-in for :class:`plugins.ondevice.HostCopy`); the slot
reads 0 (taken: what reused pinned memory may hold before the copy lands) until the test lets
the event pass or the optimizer waits on it, so that a verdict read too early is a skipped step
missed.
"""

import contextlib
import copy
import warnings

import pytest
import torch

from plugins import SAM
from plugins import ondevice
from plugins.lab.selftest.checks import protocol_step
from core_helpers import closure_for, cpu_scaler, first_backward, flat, fused_adamw_on, make_batches, make_model


class PendingEvents:
    """The events of the verdicts sent, in order, each pending until :meth:`arrive` lets it
    pass or someone waits on it (``synchronize``, counted in ``waits``).  Steps are numbered
    from 1, as the warnings number them."""

    def __init__(self):
        self.events, self.waits = [], 0

    class Event:
        def __init__(self, owner, step, copy, value):
            self.owner, self.step, self.copy, self.value, self.passed = owner, step, copy, value, False

        def _land(self):
            self.copy.copy_(self.value)  # the copy lands on the host with its event
            self.passed = True

        def query(self):
            return self.passed

        def synchronize(self):
            if not self.passed:
                self.owner.waits += 1
                self._land()

        def __deepcopy__(self, memo):
            raise TypeError("a CUDA event cannot be copied")  # as torch.cuda.Event

        __reduce_ex__ = __deepcopy__

    def install(self, monkeypatch):
        """Every verdict travels (``Verdicts.travels``) through a stand-in for
        :class:`plugins.ondevice.HostCopy` whose event passes when the test says so."""
        owner = self
        real_send = ondevice.Verdicts.send

        def send(verdicts, step, verdict, scaled=False):
            owner.step = step + 1
            real_send(verdicts, step, verdict, scaled)

        class HostCopy:
            def __init__(self, like):
                self.host, self.event = torch.empty((), dtype=like.dtype), None

            def start(self, verdict):
                self.host.zero_()  # what the (reused) pinned memory reads until the copy lands
                self.event = owner.Event(owner, owner.step, self.host, verdict.clone())
                owner.events.append(self.event)

            def arrived(self):
                return self.event.query()

            def wait(self):
                self.event.synchronize()

            def __deepcopy__(self, memo):
                raise TypeError("a CUDA event cannot be copied")  # as torch.cuda.Event

            __reduce_ex__ = __deepcopy__

        monkeypatch.setattr(ondevice.Verdicts, "send", send)
        monkeypatch.setattr(ondevice.Verdicts, "travels", staticmethod(lambda verdict: True))
        monkeypatch.setattr(ondevice, "HostCopy", HostCopy)
        return self

    def arrive(self, through=None):
        """Let the events pass up to that of step ``through`` (all of them without it): one
        stream's events pass in the order they were recorded."""
        for event in self.events:
            if through is None or event.step <= through:
                event._land()

    def pending(self):
        return [e.step for e in self.events if not e.passed]


@pytest.fixture
def pending(monkeypatch):
    return PendingEvents().install(monkeypatch)


def fused_sam():
    """SAM over fused AdamW on the CPU (the base that takes the verdict as torch's found_inf: the
    step is decided on the device from the second on, its verdict sent), and six batches."""
    model = make_model()
    opt = SAM(model.parameters(), fused_adamw_on("cpu"), lr=0.05, rho=0.2, fused=True)
    return model, opt, make_batches(6)


def skipped_step(opt, model, x, y, which):
    """One step whose ``which`` pass ("first-pass" or "second-pass") has a non-finite gradient."""
    opt.zero_grad()
    first_backward(model, x, y)
    if which == "first-pass":
        model[0].weight.grad[1, 2] = float("nan")
    if opt.perturb():
        opt.zero_grad()
        first_backward(model, x, y)
        model[0].weight.grad[1, 2] = float("inf")
    opt.descend()


@contextlib.contextmanager
def quiet():
    """Any warning fails inside."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


@pytest.mark.parametrize("which", ["first-pass", "second-pass"])
def test_a_skipped_step_is_counted_when_its_verdict_arrives_warned_with_its_own_step(pending, which):
    model, opt, batches = fused_sam()
    for x, y in batches[:3]:
        opt.step(closure_for(opt, model, x, y))
    before = flat(model.parameters())
    skipped_step(opt, model, *batches[3], which)  # step 4: skipped on the device
    torch.testing.assert_close(flat(model.parameters()), before, rtol=0, atol=1e-6)  # back at x_t, no base step
    with quiet():  # steps 5 and 6 run while step 4's verdict is on its way: nothing counted, no wait
        for x, y in batches[4:6]:
            opt.step(closure_for(opt, model, x, y))
    assert pending.pending() == [2, 3, 4, 5, 6] and pending.waits == 0
    pending.arrive(through=4)
    with pytest.warns(RuntimeWarning, match=rf"non-finite {which} gradient at step 4; the step is skipped "
                                            r"\(1 skipped so far\)"):
        opt.step(closure_for(opt, model, *batches[0]))  # step 7 finds it arrived
    assert pending.waits == 0  # counted without a wait
    with quiet():
        assert opt.nonfinite_steps == 1 and opt.num_steps == 7
    assert pending.waits == 3  # 5, 6 and 7: nonfinite_steps waits for every verdict on its way


@pytest.mark.parametrize("which", ["first-pass", "second-pass"])
def test_the_diagnostics_of_a_step_skipped_on_the_device_say_so_when_read(pending, which):
    # the step's own verdict, read with its diagnostics (one read), before it reaches the counter:
    # a non-finite h_t skips a step as surely as a non-finite g_t does (docs/diagnostics.md)
    model, opt, batches = fused_sam()
    for x, y in batches[:3]:
        opt.step(closure_for(opt, model, x, y))
    skipped_step(opt, model, *batches[3], which)  # step 4: skipped on the device
    with quiet():
        assert opt.diagnostics["nonfinite"] == 1.0, dict(opt.diagnostics)
        opt.step(closure_for(opt, model, *batches[4]))  # step 5, taken, while step 4's verdict is on its way
        assert opt.diagnostics["nonfinite"] == 0.0
    assert 4 in pending.pending() and pending.waits == 0


def test_each_late_verdict_is_warned_about_with_its_own_step(pending):
    model, opt, batches = fused_sam()
    for x, y in batches[:3]:
        opt.step(closure_for(opt, model, x, y))
    skipped_step(opt, model, *batches[3], "first-pass")   # step 4
    skipped_step(opt, model, *batches[4], "second-pass")  # step 5
    pending.arrive(through=4)
    with pytest.warns(RuntimeWarning) as caught:
        opt.step(closure_for(opt, model, *batches[5]))  # step 6: step 4's verdict is in, step 5's is not
    assert [str(w.message) for w in caught] == [
        "SAM: non-finite first-pass gradient at step 4; the step is skipped (1 skipped so far)"]
    pending.arrive()
    with pytest.warns(RuntimeWarning) as caught:
        opt.step(closure_for(opt, model, *batches[0]))  # step 7
    assert [str(w.message) for w in caught] == [
        "SAM: non-finite second-pass gradient at step 5; the step is skipped (2 skipped so far)"]
    assert pending.waits == 0


def test_nonfinite_steps_waits_for_the_verdicts_still_on_their_way(pending):
    model, opt, batches = fused_sam()
    for x, y in batches[:3]:
        opt.step(closure_for(opt, model, x, y))
    skipped_step(opt, model, *batches[3], "second-pass")  # step 4
    opt.step(closure_for(opt, model, *batches[4]))         # step 5, taken
    assert pending.pending() == [2, 3, 4, 5]
    with pytest.warns(RuntimeWarning, match="non-finite second-pass gradient at step 4"):
        assert opt.nonfinite_steps == 1
    assert pending.pending() == [] and pending.waits == 4  # it waited for each, in order
    with quiet():
        assert opt.nonfinite_steps == 1 and pending.waits == 4  # nothing left to wait for


def test_a_state_dict_saved_while_a_verdict_is_on_its_way_counts_it(pending):
    model, opt, batches = fused_sam()
    for x, y in batches[:3]:
        opt.step(closure_for(opt, model, x, y))
    skipped_step(opt, model, *batches[3], "first-pass")  # step 4, its verdict pending
    assert pending.pending() == [2, 3, 4]
    with pytest.warns(RuntimeWarning, match="non-finite first-pass gradient at step 4"):
        saved = opt.state_dict()
    assert pending.pending() == [] and pending.waits == 3
    assert {e["sam_counters"]["nonfinite_steps"] for e in saved["state"].values()} == {1}
    assert saved["sharpness"]["nonfinite_steps"] == 1 and saved["sharpness"]["step"] == 4
    # loaded elsewhere: the count comes with it, and nothing is warned about again
    model2 = make_model()
    opt2 = SAM(model2.parameters(), fused_adamw_on("cpu"), lr=0.05, rho=0.2, fused=True)
    with quiet():
        opt2.load_state_dict(saved)
        assert opt2.nonfinite_steps == 1 and opt2.num_steps == 4


def test_a_checkpoint_loaded_while_a_verdict_is_on_its_way_leaves_it_to_the_run_left_behind(pending):
    model, opt, batches = fused_sam()
    for x, y in batches[:3]:
        opt.step(closure_for(opt, model, x, y))
    saved = opt.state_dict()  # after step 3: its verdicts waited for, none skipped
    skipped_step(opt, model, *batches[3], "first-pass")  # step 4, its verdict pending
    waits = pending.waits
    with pytest.warns(RuntimeWarning, match="non-finite first-pass gradient at step 4"):
        opt.load_state_dict(saved)  # counted, and warned about, in the run being replaced
    assert pending.pending() == [] and pending.waits == waits + 1
    with quiet():
        assert opt.nonfinite_steps == 0 and opt.num_steps == 3
        opt.step(closure_for(opt, model, *batches[4]))  # step 4 again, taken
        pending.arrive()
        assert opt.nonfinite_steps == 0 and opt.num_steps == 4


def test_a_copy_made_while_a_verdict_is_on_its_way_counts_it_first(pending):
    """A deep copy (or a pickle) cannot carry an event: the original waits for its verdicts
    first, and the copy starts with their count."""
    model, opt, batches = fused_sam()
    for x, y in batches[:3]:
        opt.step(closure_for(opt, model, x, y))
    skipped_step(opt, model, *batches[3], "second-pass")
    with pytest.warns(RuntimeWarning, match="non-finite second-pass gradient at step 4"):
        twin = copy.deepcopy(opt)
    with quiet():
        assert twin.nonfinite_steps == opt.nonfinite_steps == 1 and pending.pending() == []


def test_an_overflow_under_a_scaler_is_counted_late_and_never_warned(pending):
    """Under a GradScaler an overflow is the scaler's routine signal: its step's verdict is
    counted when it arrives, without a warning, then or later."""
    model, opt, batches = fused_sam()
    scaler = cpu_scaler(init_scale=2.0 ** 10, growth_interval=1000)
    with quiet():
        for t, (x, y) in enumerate(batches):
            def backward():
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                if t == 3:
                    model[3].bias.grad[0] = float("inf")
                return loss

            protocol_step(opt, model, backward, "explicit", scaler)
        assert pending.pending() == [2, 3, 4, 5, 6] and scaler.get_scale() == 2.0 ** 9
        pending.arrive(through=4)
        protocol_step(opt, model, backward, "explicit", scaler)  # step 7: counted here, quietly
        assert opt.nonfinite_steps == 1
