document.querySelector("#app").textContent = "replace me";
