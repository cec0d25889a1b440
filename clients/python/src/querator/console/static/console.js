// Small conveniences; every page works without them (the server checks everything).
document.addEventListener("DOMContentLoaded", () => {
  const all = document.getElementById("select-all");
  if (all) {
    all.addEventListener("change", () => {
      for (const box of document.querySelectorAll('input[name="item"]')) box.checked = all.checked;
    });
  }
  // Purge stays disabled until the queue's name is typed (the server checks it too).
  const confirm = document.getElementById("purge-confirm");
  const purge = document.getElementById("purge");
  if (confirm && purge) {
    const update = () => { purge.disabled = confirm.value !== confirm.dataset.expect; };
    confirm.addEventListener("input", update);
    update();
  }
});
