app_name = "portal"
urlpatterns: list = []
